"""What a command leaves behind and how it ends (experiments/outputs.py; docs/cli.md "Errors, exit
codes, signals" and "Outputs"): one line per error (2 for usage, 1 for a failed run, naming the
flag that sets a library parameter), 130/143 after SIGINT/SIGTERM; nothing of the user's or of
another run is ever deleted, an interrupted or failed run leaves the previous outputs as they were,
links at output names are refused, ``--out`` is checked before any compute, results.json is strict
JSON.

Each case checks the exit code and that the flag or file is in the one line, never the message's
wording.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pycore
from experiments import common, house_price
from pycore import DivergenceError, ParameterError
from pycore.report import read_json
from tests.cli_helpers import call, one_line

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--seeds",
    "1",
    "--methods",
    "identity,closed_form",
    "--probe-steps",
    "2",
    "--jobs",
    "1",
    "--no-plot",
]
HP_TINY = ["--seeds", "1", "--methods", "identity", "--probe-steps", "2", "--jobs", "1"]
TWO_SEEDS = [
    "--seeds",
    "2",
    "--methods",
    "ours",
    "--epochs",
    "1",
    "--probe-steps",
    "2",
    "--no-plot",
]


# --- errors, warnings and signals ----------------------------------------------------------------


def test_a_library_error_names_the_flag_that_sets_it(capsys, tmp_path, monkeypatch):
    """DivergenceError("lambda_h", ...) → exit 1 naming --lambda-h, also from a worker process
    (the exception crosses the pickle with .parameter); ParameterError → exit 2; a parameter no
    flag sets still gives one line."""

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
            monkeypatch.setattr(pycore, name, raiser(exc))
        for jobs in ("1", "2") if code == 1 and flag != "betas" else ("1",):
            rc, err = call(
                capsys, house_price, [*TWO_SEEDS, "--jobs", jobs, "--out", str(tmp_path / "o")]
            )
            assert rc == code and one_line(err, flag)
    assert not (tmp_path / "o").exists()


def test_data_errors_are_exit_1_one_line(capsys, tmp_path):
    csv = tmp_path / "train.csv"
    csv.write_text("Id,MSZoning,LotArea\n1,RL,8450\n2,RM,9600\n")
    rc, err = call(capsys, house_price, ["--data", str(csv), "--out", str(tmp_path / "o")])
    assert rc in (1, 2) and one_line(err, str(csv))  # names the file (not the Kaggle column set)
    rc, err = call(capsys, house_price, ["--n-train", "5000", "--out", str(tmp_path / "o")])
    assert rc in (1, 2) and "n_train" in one_line(err).replace("-", "_")
    assert not (tmp_path / "o").exists()


def test_unexpected_error_is_one_line_and_debug_prints_the_traceback(
    capsys, tmp_path, monkeypatch
):
    def bug(args):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(house_price, "run", bug)
    rc, err = call(capsys, house_price, ["--out", str(tmp_path / "o")])
    assert rc == 1 and one_line(err, "TypeError", "--debug")
    rc, err = call(capsys, house_price, ["--out", str(tmp_path / "o"), "--debug"])
    assert rc == 1 and "Traceback" in err
    assert err.strip().splitlines()[-1].startswith("house_price.py: error:")


def test_a_warning_is_one_line(capsys, tmp_path, monkeypatch):
    import warnings

    def warn(args):
        warnings.warn("column 'GrLivArea' line 6: 1e308 is an outlier")
        raise ValueError("stop")

    monkeypatch.setattr(house_price, "run", warn)
    rc, err = call(capsys, house_price, ["--out", str(tmp_path / "o")])
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
            rc, err = call(capsys, house_price, ["--out", str(tmp_path / "o")])
            assert signal.getsignal(signal.SIGINT) is sigint
        finally:
            signal.signal(signal.SIGINT, previous)
        assert rc == 143 and one_line(err, "SIGTERM")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigterm_ends_a_run_whose_thread_is_stuck(tmp_path):
    """The interpreter waits for every non-daemon thread at exit: main ends the process on
    SIGTERM (143) even while one is stuck."""
    code = (
        "import threading, time\nfrom experiments import common\n"
        "def body(args):\n"
        "    threading.Thread(target=threading.Event().wait).start()  # stuck for ever\n"
        "    print('started', flush=True)\n    time.sleep(60)\n"
        "raise SystemExit(common.main(common.Parser('stuck'), body))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "started"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 143
    finally:
        proc.kill()
        proc.wait()


# --- outputs -----------------------------------------------------------------------------------


def _snapshot(folder: Path) -> dict:
    """Every entry under ``folder`` (hidden ones and links included) with its content."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for n in dirs + files:
            p = Path(root) / n
            rel = str(p.relative_to(folder))
            out[rel] = os.readlink(p) if p.is_symlink() else None if p.is_dir() else p.read_bytes()
    return out


def test_nothing_but_this_runs_own_files_is_touched(capsys, tmp_path):
    """A run replaces only the files it writes, by name: a user's
    OUT/ci/extractor_ours_backup.safetensors, which an output glob would match, stays."""
    out = tmp_path / "out"
    (out / "ci").mkdir(parents=True)
    (out / "ci" / "extractor_ours_backup.safetensors").write_bytes(b"45 MB of weights")
    (out / "thetas_backup.npz").write_bytes(b"mine")
    (out / "results.json.bak").write_text("an earlier result, kept by hand")
    (out / ".results.json.4242-abcd.json").write_text("another run's temporary file")
    (out / "norm_ratio.png").write_bytes(b"an earlier figure")
    (out / "link").symlink_to(tmp_path / "elsewhere")
    before = _snapshot(out)
    rc, err = call(capsys, house_price, [*TINY, "--out", str(out)])
    assert rc == 0, err
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if k in before} == before  # --no-plot: the figure stays
    assert set(after) - set(before) == {"results.json", "table.md", "thetas.npz"}


def test_a_concurrent_run_cannot_remove_a_live_runs_files(tmp_path):
    """No run deletes anything: run B (another PID namespace: it cannot see A's PID), writing
    into the same folder while A is half-way through its files, leaves A's temporary file and A's
    finished files alone."""
    seen = {}

    def a_writes_its_figure(path):
        common.write_outputs(tmp_path, {"results.json": "B", "table.md": "B"})  # B, start to end
        seen["a_tmp_alive"] = Path(path).exists()
        Path(path).write_text("A's figure")

    common.write_outputs(
        tmp_path, {"table.md": "A", "fig.png": a_writes_its_figure, "results.json": "A"}
    )
    assert seen["a_tmp_alive"]
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {  # A's set, moved in whole
        "table.md": "A",
        "fig.png": "A's figure",
        "results.json": "A",
    }


@pytest.mark.parametrize(
    "exc,code",
    [(KeyboardInterrupt(), 130), (common.Terminated(), 143), (ValueError("bad data"), 1)],
)
def test_an_interrupted_or_failed_run_leaves_the_previous_outputs(
    capsys, tmp_path, monkeypatch, exc, code
):
    out = tmp_path / "hp"
    assert house_price.main([*TINY, "--out", str(out)]) == 0
    before = _snapshot(out)

    def fail(args):
        raise exc

    monkeypatch.setattr(house_price, "run", fail)
    rc, err = call(capsys, house_price, [*TINY, "--out", str(out)])
    assert rc == code and one_line(err)
    assert _snapshot(out) == before


@pytest.mark.parametrize("exc,code", [(OSError(28, "No space left on device"), 1), (None, 130)])
def test_a_failure_or_interrupt_while_writing_leaves_every_earlier_output(
    capsys, tmp_path, monkeypatch, exc, code
):
    """The figure, written after table.md, fails half-way or is interrupted (Ctrl-C): every
    earlier output is left byte for byte (none new beside old ones), and no temporary file."""
    out = tmp_path / "hp"
    argv = [*TINY, "--out", str(out)]
    assert house_price.main(argv) == 0
    before = _snapshot(out)

    def broken_plot(result, path):
        Path(path).write_bytes(b"half a png")
        raise exc or KeyboardInterrupt()

    monkeypatch.setattr(house_price, "plot_norm_ratio", broken_plot)
    rc, err = call(capsys, house_price, [a for a in argv if a != "--no-plot"])
    assert rc == code and one_line(err)
    assert _snapshot(out) == before


def test_sigint_while_the_outputs_move_into_place_leaves_them_all_new(capsys, tmp_path):
    """SIGINT arrives between the moves of two output files (results.json's is the last): the
    run ends 130 with every output new (none of the earlier run's beside them)."""
    out = tmp_path / "hp"
    argv = [*HP_TINY, "--out", str(out)]
    assert house_price.main(argv) == 0
    capsys.readouterr()
    old = {p.name: p.stat().st_ino for p in out.iterdir()}
    code = (
        "import os, signal, sys\nfrom experiments import house_price\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal\n"
        "real = os.replace\n"
        "def replace(src, dst):\n"
        "    if os.path.basename(dst) == 'results.json':  # a file moved before it, one after\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(src, dst)\n"
        "os.replace = replace\n"
        "sys.exit(house_price.main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 130, proc.stderr
    new = {p.name: p.stat().st_ino for p in out.iterdir()}
    assert set(new) == set(old) and all(new[n] != old[n] for n in old)  # each file replaced


def test_commit_gives_every_output_the_umasks_mode(tmp_path):
    """A staged file written 0600 (as safetensors writes) lands with the mode every other output
    gets under the umask."""
    umask = os.umask(0o022)
    os.umask(umask)
    staged, plain = tmp_path / ".m.tmp", tmp_path / "plain.txt"
    staged.write_bytes(b"weights")
    staged.chmod(0o600)
    common.write_outputs(tmp_path, {"plain.txt": "x"})
    common.commit([(staged, tmp_path / "extractor_ours.safetensors")])
    mode = (tmp_path / "extractor_ours.safetensors").stat().st_mode & 0o777
    assert mode == plain.stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize(
    "make", ["file", "under_a_file", "output_name_is_a_folder", "read_only", "in_proc"]
)
def test_out_is_checked_before_any_compute(tripwire, capsys, tmp_path, monkeypatch, make):
    """Among them a folder where nothing can be made even by root (/proc/x)."""
    if make == "in_proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    f = tmp_path / "file"
    f.write_text("keep me")
    out = {"file": f, "under_a_file": f / "sub", "in_proc": Path("/proc/x")}.get(
        make, tmp_path / "out"
    )
    if make == "output_name_is_a_folder":
        (out / "table.md").mkdir(parents=True)
    if make == "read_only":  # tests may run as root, for whom chmod does not bind
        out.mkdir()
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) == out else real(p, m))
    rc, err = call(capsys, house_price, ["--out", str(out)])
    assert rc == 2 and one_line(err, "--out")
    assert f.read_text() == "keep me"


def test_results_json_is_strict_json(capsys, tmp_path):
    assert house_price.main([*TINY, "--out", str(tmp_path)]) == 0
    text = (tmp_path / "results.json").read_text()
    raw = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert (
        raw["ceiling"] == "Infinity" and read_json(tmp_path / "results.json")["ceiling"] == np.inf
    )
    capsys.readouterr()


@pytest.mark.parametrize("target", ["notes.txt", "nowhere/dangling"])
def test_a_symlink_at_an_output_name_is_refused_and_left_alone(capsys, tmp_path, target):
    out, notes = tmp_path / "out", tmp_path / "notes.txt"
    out.mkdir()
    notes.write_text("my notes")
    (out / "table.md").symlink_to(tmp_path / target)
    rc, err = call(capsys, house_price, [*HP_TINY, "--no-plot", "--out", str(out)])
    assert rc == 2 and one_line(err, "--out", "table.md")
    assert (out / "table.md").is_symlink() and notes.read_text() == "my notes"
    assert not (out / "results.json").exists()


def test_write_outputs_refuses_a_link_before_writing_anything(tmp_path):
    (tmp_path / "b.txt").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(common.RunError, match="b.txt"):
        common.write_outputs(tmp_path, {"a.txt": "1", "b.txt": "2"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt"]


def test_a_failed_write_names_the_output_not_its_temporary(capsys, tmp_path, monkeypatch):
    def full_disk(result, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(house_price, "plot_norm_ratio", full_disk)
    out = tmp_path / "out"
    rc, err = call(capsys, house_price, [*HP_TINY, "--out", str(out)])
    line = one_line(err, str(out / "norm_ratio.png"))
    assert rc == 1 and ".norm_ratio." not in line
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # the temporary is gone


def test_a_run_with_stderr_closed_succeeds(tmp_path):
    argv = [sys.executable, str(ROOT / "experiments" / "house_price.py"), *HP_TINY, "--no-plot"]
    argv += ["--out", str(tmp_path / "o")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = " ".join(f"'{a}'" for a in argv) + " 2>&-"
    out = subprocess.run(
        ["sh", "-c", cmd], capture_output=False, stdout=subprocess.PIPE, env=env, timeout=300
    )
    assert out.returncode == 0 and (tmp_path / "o" / "results.json").exists()
