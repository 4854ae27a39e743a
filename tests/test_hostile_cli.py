"""The command lines' guarantees (experiments/flags.py, outputs.py, pool.py; docs/cli.md): a
usage error is exit 2 and one stderr line naming the flag, before any compute; every count is
bounded and its bound is in --help; a library error names the flag that sets it; signals end the
run and every worker.

Each case checks the exit code and that the flag is in the one line, never the message's wording.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments import attacks, common, frontier, house_price, mnist
from pycore import DivergenceError, ParameterError
from tests.cli_helpers import call, one_line

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
SCRIPTS = (house_price, mnist, frontier, attacks)
TINY_HP = ["--seeds", "2", "--methods", "ours", "--epochs", "1", "--probe-steps", "2", "--no-plot"]

# a library check
# a repeated pair would count twice in every mean
USAGE_CASES = [  # (module, argv, the flag the one line must name)
    (house_price, ["--seeds", "4-2"], "--seeds"),
    (house_price, ["--seeds", "0,-1"], "--seeds"),
    (house_price, ["--seeds", "0,0"], "--seeds"),
    (house_price, ["--seeds", "0"], "--seeds"),
    (house_price, ["--seeds", "99999999999"], "--seeds"),
    (house_price, ["--lr", "nan"], "--lr"),
    (house_price, ["--lr", "0"], "--lr"),  # the library's bound, checked before compute
    (house_price, ["--lambda-h", "-inf"], "--lambda-h"),
    (house_price, ["--epochs", "1e9"], "--epochs"),
    (house_price, ["--epochs", "100000000000000000000000"], "--epochs"),
    (house_price, ["--jobs", "0"], "--jobs"),
    (house_price, ["--n-train", "1"], "--n-train"),
    (house_price, ["--probe-steps", "1000000000"], "--probe-steps"),
    (house_price, ["--methods", "ours,bogus"], "--methods"),
    (house_price, ["--methods", "ours,ours"], "--methods"),
    (house_price, ["--methods", ","], "--methods"),
    (house_price, ["--precond", "magic"], "--precond"),
    (house_price, ["--methods", "closed_form", "--exponent", "nan"], "--exponent"),
    (house_price, ["--methods", "ours", "--precond", "ridge", "--ridge", "0"], "--ridge"),
    (house_price, ["--data", "/nonexistent/train.csv"], "--data"),
    (house_price, ["--seed", "3"], "--seed"),  # no abbreviation of --seeds
    (house_price, ["--bogus"], "--bogus"),
    (mnist, ["--pairs", "3-3"], "--pairs"),
    (mnist, ["--pairs", "0-1,3-8,0-1"], "--pairs"),
    (mnist, ["--n-heldout", "0"], "--n-heldout"),
    (mnist, ["--mnist-dir", "/nonexistent"], "--mnist-dir"),
    (frontier, ["--grid-epochs", "1e9"], "--grid-epochs"),
    (frontier, ["--exponents", ",".join(map(str, range(10_000)))], "--exponents"),
    (frontier, ["--lr-grid", "0.1,-1"], "--lr-grid"),
    (frontier, ["--seeds", "5000"], "--seeds"),  # 5000 × 20 runs: over the bound on runs
    (attacks, ["--orders", "1000000000"], "--orders"),  # ran 19 s, then MemoryError (issue 27)
    (attacks, ["--max-steps", "1000000000"], "--max-steps"),
    (attacks, ["--mnist-epochs", "1e9"], "--mnist-epochs"),
    (attacks, ["--eps", "0"], "--eps"),
    (attacks, ["--attackers", "gd_exact,psychic"], "--attackers"),
    (attacks, ["--methods", "ours", "--hardened-methods", "closed_form"], "--hardened-methods"),
    (attacks, ["--mnist-only"], "--mnist-only"),
    (attacks, ["--logistic-ridge", "0"], "--logistic-ridge"),
]


@pytest.mark.parametrize(
    "mod,argv,flag",
    USAGE_CASES,
    ids=[f"{m.__name__.split('.')[-1]}:{' '.join(a)[:40]}" for m, a, _ in USAGE_CASES],
)
def test_usage_error_is_exit_2_one_line_naming_the_flag_before_compute(
    tripwire, capsys, tmp_path, mod, argv, flag
):
    rc, err, elapsed = call(capsys, mod, [*argv, "--out", str(tmp_path / "out")])
    assert rc == 2, err
    assert one_line(err, flag).startswith(f"{mod.build_parser().prog}: error: ")
    assert elapsed < 1.0 and not (tmp_path / "out").exists()


def test_an_option_no_chosen_method_has_is_refused(tripwire, capsys, tmp_path):
    for argv, flag in (
        (["--methods", "ours", "--inner-steps", "5"], "--inner-steps"),
        (["--methods", "identity,closed_form", "--lr", "0.1"], "--lr"),
        (["--methods", "imma", "--certified"], "--certified"),
    ):
        rc, err, _ = call(capsys, house_price, [*argv, "--out", str(tmp_path / "o")])
        assert rc == 2 and one_line(err, flag)
    args = house_price.parse_args(["--methods", "imma,ours", "--inner-steps", "5", "--lr", "0.01"])
    assert args.immunizer.given == {"imma": {"inner_steps": 5, "lr": 0.01}, "ours": {"lr": 0.01}}


@pytest.mark.parametrize("mod", (house_price, mnist, attacks), ids=lambda m: m.__name__)
def test_every_linear_option_has_its_flag_and_the_library_checks_it(mod, tmp_path):
    """A flag per option of every method (Adam's betas pair aside), each reaching the library as
    typed: a value the library refuses is a usage error naming that flag."""
    from pycore import METHODS, CertifiedOptions, options_of

    parser = mod.build_parser()
    dests = {a.dest for a in parser._actions if a.option_strings}
    names = {*CertifiedOptions.names(), *(n for m in METHODS for n in options_of(m).names())}
    assert names - {"betas"} <= dests
    args = parser.parse_args(["--lambda-h", "2.5", "--batch-size", "none", "--no-log"])
    assert common.given_options(args, names) == {
        "lambda_h": 2.5,
        "batch_size": None,
        "log": False,
    }


@pytest.mark.parametrize("mod", SCRIPTS, ids=lambda m: m.__name__)
def test_every_count_is_bounded_and_its_bound_is_in_help(mod):
    parser = mod.build_parser()
    text = "".join(parser.format_help().split())  # argparse wraps long words anywhere
    counts = [
        a for a in parser._actions if getattr(a.type, "__name__", "") in ("count", "seeds", "list")
    ]
    assert counts
    for action in counts:
        bound = action.type.bound
        assert "to" in bound or "at most" in bound or "from" in bound, (
            action.option_strings,
            bound,
        )
        assert "".join(bound.split()) in text, (action.option_strings, bound)


def test_a_library_error_names_the_flag_that_sets_it(capsys, tmp_path, monkeypatch):
    """DivergenceError("lambda_h", ...) → exit 1 naming --lambda-h, also from a worker process
    (the exception crosses the pickle with .parameter); ParameterError → exit 2; a parameter no
    flag sets still gives one line."""
    module = importlib.import_module("pycore.immunization")

    def raiser(exc):
        def immunize(*a, **k):
            raise exc

        return immunize

    for exc, code, flag in (
        (DivergenceError("lambda_h", "θ non-finite"), 1, "--lambda-h"),
        (ParameterError("inner_lr", "too large"), 2, "--inner-lr"),
        (DivergenceError("betas", "θ became non-finite"), 1, "betas"),
    ):
        for name in ("immunize", "immunize_batch"):  # the runners step seeds together
            monkeypatch.setattr(module, name, raiser(exc))
        for jobs in ("1", "2") if code == 1 and flag != "betas" else ("1",):
            rc, err, _ = call(
                capsys, house_price, [*TINY_HP, "--jobs", jobs, "--out", str(tmp_path / "o")]
            )
            assert rc == code and one_line(err, flag)
    assert not (tmp_path / "o").exists()


def test_data_errors_are_exit_1_one_line(capsys, tmp_path):
    csv = tmp_path / "train.csv"
    csv.write_text("Id,MSZoning,LotArea\n1,RL,8450\n2,RM,9600\n")
    rc, err, _ = call(capsys, house_price, ["--data", str(csv), "--out", str(tmp_path / "o")])
    assert rc in (1, 2) and one_line(err, str(csv))  # names the file (not the Kaggle column set)
    rc, err, _ = call(capsys, house_price, ["--n-train", "5000", "--out", str(tmp_path / "o")])
    assert rc in (1, 2) and "n_train" in one_line(err).replace("-", "_")
    assert not (tmp_path / "o").exists()


def test_unexpected_error_is_one_line_and_debug_prints_the_traceback(
    capsys, tmp_path, monkeypatch
):
    def bug(args):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(house_price, "run", bug)
    rc, err, _ = call(capsys, house_price, ["--out", str(tmp_path / "o")])
    assert rc == 1 and one_line(err, "TypeError", "--debug")
    rc, err, _ = call(capsys, house_price, ["--out", str(tmp_path / "o"), "--debug"])
    assert rc == 1 and "Traceback" in err
    assert err.strip().splitlines()[-1].startswith("house_price.py: error:")


def test_a_warning_is_one_line(capsys, tmp_path, monkeypatch):
    import warnings

    def warn(args):
        warnings.warn("column 'GrLivArea' line 6: 1e308 is an outlier")
        raise ValueError("stop")

    monkeypatch.setattr(house_price, "run", warn)
    rc, err, _ = call(capsys, house_price, ["--out", str(tmp_path / "o")])
    assert (
        rc == 1
        and err.startswith("house_price.py: warning: ")
        and len(err.strip().splitlines()) == 2
    )


def test_signals_in_the_process_are_background_job_safe(capsys, tmp_path, monkeypatch):
    """main never installs a SIGINT handler nor overrides an inherited SIG_IGN (``cmd &``), leaves
    SIGTERM as it found it, and maps KeyboardInterrupt / SIGTERM to 130 / 143."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        pytest.skip("SIGTERM is handled by the test runner here")
    for sigint in (signal.SIG_IGN, signal.default_int_handler):
        monkeypatch.setattr(house_price, "run", lambda args: os.kill(os.getpid(), signal.SIGTERM))
        previous = signal.signal(signal.SIGINT, sigint)
        try:
            rc, err, _ = call(capsys, house_price, ["--out", str(tmp_path / "o")])
            assert signal.getsignal(signal.SIGINT) is sigint
        finally:
            signal.signal(signal.SIGINT, previous)
        assert rc == 143 and one_line(err, "SIGTERM")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _pid(_):
    return os.getpid()


def _raise_in_worker(i):
    raise ParameterError("lambda_h", f"from worker {os.getpid()}")


@pytest.mark.skipif(common.usable_cores() < 2, reason="one core: pool_map runs serially")
def test_pool_map_caps_jobs_and_errors_arrive_as_themselves():
    pids = common.pool_map(_pid, range(6), jobs=64)
    assert os.getpid() not in pids and len(set(pids)) <= common.usable_cores()
    assert common.pool_map(_pid, [0], jobs=64) == [os.getpid()]  # one task: no fork
    with pytest.raises(ParameterError) as e:
        common.pool_map(_raise_in_worker, [0, 1], jobs=2)
    assert e.value.parameter == "lambda_h" and f"worker {os.getpid()}" not in str(e.value)


# --- real processes
# -------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == pid and stat[0] != "Z":
            out.append(int(d))
    return out


def _alive(pids) -> list[int]:
    return [
        p
        for p in pids
        if Path(f"/proc/{p}").exists()
        and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_run_leaves_no_worker_and_no_output(tmp_path, sig):
    p = subprocess.Popen(
        [
            sys.executable,
            "experiments/house_price.py",
            "--seeds",
            "4",
            "--jobs",
            "2",
            "--no-plot",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    t0 = time.time()
    while len(_children(p.pid)) < 2 and p.poll() is None and time.time() - t0 < 60:
        time.sleep(0.05)
    workers = _children(p.pid)
    assert len(workers) >= 2, p.stderr.read() if p.poll() is not None else "no workers after 60 s"
    p.send_signal(sig)
    err = p.communicate(timeout=30)[1]
    t0 = time.time()
    # SIGKILL: the workers notice their parent is gone
    while _alive(workers) and time.time() - t0 < 5:
        time.sleep(0.05)
    left = _alive(workers)
    for pid in left:  # a failing test must not leak them
        os.kill(pid, signal.SIGKILL)
    assert left == [], f"workers outlived the run: {left}"
    if sig == signal.SIGTERM:
        assert p.returncode == 143 and one_line(err, "SIGTERM")
    assert list(tmp_path.iterdir()) == []


def test_scripts_run_from_the_checkout_as_files_and_as_modules(tmp_path):
    """No PYTHONPATH and no installed ``experiments``: ``python -m experiments.X`` from the root
    and ``python experiments/X.py`` from any folder run this checkout's code (the traceback that
    --debug prints shows the file that raised)."""
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    for cmd, cwd in (
        (["-m", "experiments.mnist"], ROOT),
        ([str(ROOT / "experiments" / "mnist.py")], tmp_path),
    ):
        proc = subprocess.run(
            [sys.executable, *cmd, "--seeds", "4-2", "--debug"],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "--seeds" in proc.stderr.splitlines()[-1]
        assert str(ROOT / "experiments" / "flags.py") in proc.stderr
