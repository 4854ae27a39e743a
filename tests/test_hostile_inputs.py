"""Hostile inputs to the library and the command lines (docs/cli.md): absurd cells, large files,
huge counts, flags that change nothing, non-ASCII digits, repeated pairs, zero matrices, Ctrl-C
during the imports; and the library's exceptions crossing a process boundary as themselves.

The CLI cases assert the exit code and the key words of the one stderr line.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from experiments import attacks, cli, deepnet, house_price, mnist
from pycore import validation
from pycore.data.house_price import default_path, load_house_price
from pycore.immunize import ImmunizeConfig, check_fields_apply
from pycore.metrics import rir_ceiling
from pycore.probe import gd_exact_line_search
from pycore.spectral import SpectrumError
from pycore.validation import DivergenceError, OutlierWarning, ParameterError
from tests.cli_helpers import call, one_line

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
SCRIPTS = (house_price, mnist, attacks, deepnet)


@pytest.fixture(scope="module")
def hp_lines() -> list[str]:
    return default_path().read_text().splitlines()


def _col(lines, name) -> int:
    return lines[0].split(",").index(name)


def _with_cell(lines, row, name, value) -> list[str]:
    out = list(lines)
    cells = out[row + 1].split(",")
    cells[_col(lines, name)] = value
    out[row + 1] = ",".join(cells)
    return out


def _write(path: Path, lines) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# --- an absurd cell: 1e308 in GrLivArea ------------------------------------------------------------

def test_absurd_cell_warns_naming_column_line_and_value(tmp_path, hp_lines):
    """It used to be accepted silently, leaving GrLivArea a constant column for every other row."""
    csv = _write(tmp_path / "train.csv", _with_cell(hp_lines, 4, "GrLivArea", "1e308"))
    with pytest.warns(OutlierWarning) as rec:
        load_house_price(csv)
    msgs = [str(w.message) for w in rec if issubclass(w.category, OutlierWarning)]
    assert len(msgs) == 1 and "\n" not in msgs[0]
    assert "'GrLivArea'" in msgs[0] and "line 6" in msgs[0] and "1e+308" in msgs[0] and str(csv) in msgs[0]
    with pytest.raises(ValueError, match=r"'GrLivArea' has 1e\+308 \(line 6\)"):
        load_house_price(csv, on_outlier="error")
    with pytest.raises(ParameterError) as e:
        load_house_price(csv, on_outlier="sometimes")
    assert e.value.parameter == "on_outlier"


def test_the_real_file_has_no_outlier():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", OutlierWarning)
        load_house_price()


def test_outlier_rule():
    x = np.array([0, 0, 4.0, 4.0, 3.0, 5.0, 0.0])                   # median of the nonzero cells: 4
    assert validation.outliers(x).size == 0
    assert validation.outliers(np.append(x, 4e6)).size == 0          # 1e6 × the median: not above
    assert list(validation.outliers(np.append(x, -4.1e6))) == [7]      # magnitude, either sign
    assert validation.outliers(np.array([0.0, 0.0, 1e300])).size == 0  # one nonzero cell: no scale


def test_absurd_cell_on_the_command_line(capsys, tmp_path, hp_lines):
    csv = _write(tmp_path / "train.csv", _with_cell(hp_lines, 4, "GrLivArea", "1e308"))
    argv = ["--data", str(csv), "--seeds", "1", "--methods", "identity", "--probe-steps", "2", "--jobs", "1",
            "--no-plot"]
    rc, err, _ = call(capsys, house_price, [*argv, "--out", str(tmp_path / "o")])
    assert rc == 0 and one_line(err, "house_price.py: warning:", "'GrLivArea'", "line 6", "1e+308")
    rc, err, _ = call(capsys, house_price, [*argv, "--on-outlier", "error", "--out", str(tmp_path / "o2")])
    assert rc == 1 and one_line(err, "house_price.py: error:", "'GrLivArea'", "line 6", "1e+308")
    assert not (tmp_path / "o2").exists()


# --- a large legitimate file: bounded memory ------------------------------------------------------

def test_tall_csv_runs_in_bounded_memory(tmp_path, hp_lines):
    """31,200 rows, 30,700 of them held-out D_P rows.  rir_ceiling's full SVD of the held-out X_P
    used to allocate a 30,700 × 30,700 U (7 GiB; 35k rows of a 50 MB file: 10 GB, minutes inside
    LAPACK, deaf to SIGTERM).  Run under a 3 GiB address-space limit."""
    z = _col(hp_lines, "MSZoning")
    P = [line for line in hp_lines[1:] if line.split(",")[z] != "RL"]
    H = [line for line in hp_lines[1:] if line.split(",")[z] == "RL"][:300]
    csv = _write(tmp_path / "tall.csv", [hp_lines[0], *H, *(P * 100)])
    code = ("import resource, runpy, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
            f"sys.argv = ['experiments/house_price.py', '--data', {str(csv)!r}, '--seeds', '1', "
            "'--methods', 'identity', '--probe-steps', '1', '--no-plot', '--jobs', '1', "
            f"'--out', {str(tmp_path / 'o')!r}]\n"
            "sys.path.insert(0, 'experiments')\n"
            "runpy.run_path('experiments/house_price.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = house_price_results(tmp_path / "o")
    assert res["data"]["heldout_rows_P"] == 30_700


def house_price_results(out: Path) -> dict:
    from pycore.report import read_json

    return read_json(out / "results.json")


def test_a_size_that_cannot_fit_is_refused_up_front_naming_it(monkeypatch):
    monkeypatch.setattr(validation, "MAX_DENSE_BYTES", 1 << 20)   # 1 MiB
    rng = np.random.default_rng(0)
    X = rng.standard_normal((5000, 40))                           # U alone would be 5000 × 40
    with pytest.raises(ValueError, match=r"5000 × 40 float64 array needs .* GiB") as e:
        rir_ceiling(X, X[:100])
    assert "MAX_DENSE_BYTES" in str(e.value)
    with pytest.raises(ValueError, match=r"the inputs of its 1460 rows: a 1460 × 79 float64 array"):
        monkeypatch.setattr(validation, "MAX_DENSE_BYTES", 1 << 16)
        load_house_price()


# --- huge counts ------------------------------------------------------------------------------------

COUNT_CASES = [
    (house_price, ["--epochs", "100000000000000000000000"], ["--epochs", "≤ 100000"]),
    (house_price, ["--imma-inner-steps", "1000000000"], ["--imma-inner-steps", "≤ 1000"]),
    (house_price, ["--probe-steps", "1000000000"], ["--probe-steps", "≤ 100000"]),
    (mnist, ["--epochs", "1000000000"], ["--epochs", "≤ 100000"]),
    (attacks, ["--max-steps", "1000000000"], ["--max-steps", "≤ 1000000"]),
    (attacks, ["--mnist-max-steps", "1000000000"], ["--mnist-max-steps", "≤ 1000000"]),
    (attacks, ["--mnist-epochs", "1000000000"], ["--mnist-epochs", "100000"]),
    (attacks, ["--epochs", "1000000000"], ["--epochs", "≤ 100000"]),
]


@pytest.mark.parametrize("mod,argv,words", COUNT_CASES,
                         ids=[f"{m.__name__.split('.')[-1]}:{' '.join(a)}" for m, a, _ in COUNT_CASES])
def test_huge_counts_are_refused_before_compute(tripwire, capsys, tmp_path, mod, argv, words):
    """--probe-steps 1e9 used to fill memory (the probe pads its lists to that length), --epochs
    1e23 and --imma-inner-steps 1e9 to run until killed."""
    rc, err, elapsed = call(capsys, mod, [*argv, "--out", str(tmp_path / "o")])
    assert rc == 2 and one_line(err, *words) and elapsed < 1.0


def test_huge_counts_in_the_library():
    for field, value in (("epochs", 10**23), ("imma_inner_steps", 10**9)):
        with pytest.raises(ParameterError) as e:
            ImmunizeConfig(**{field: value})
        assert e.value.parameter == field
    t0 = time.perf_counter()
    with pytest.raises(ParameterError) as e:
        gd_exact_line_search(np.eye(3), np.ones(3), 10**9)
    assert e.value.parameter == "steps" and time.perf_counter() - t0 < 1.0


# --- a flag no chosen method reads -------------------------------------------------------------------

def test_flag_that_no_chosen_method_reads_is_refused(tripwire, capsys, tmp_path):
    cases = ((["--methods", "ours", "--imma-inner-steps", "5"], "--imma-inner-steps", "imma"),
             (["--methods", "identity,closed_form", "--lr", "0.1"], "--lr", "ours"),
             (["--methods", "imma", "--certified"], "--certified", "ours"))
    for argv, flag, readers in cases:
        rc, err, _ = call(capsys, house_price, [*argv, "--out", str(tmp_path / "o")])
        assert rc == 2 and one_line(err, f"error: {flag}:", "not read by", readers)
    rc, err, _ = call(capsys, mnist, ["--methods", "ours", "--lambda-kappa", "2",
                                      "--out", str(tmp_path / "o")])
    assert rc == 2 and one_line(err, "--lambda-kappa", "opt_kappa")
    # read by one of the chosen methods: accepted
    args = house_price.parse_args(["--methods", "imma,ours", "--imma-inner-steps", "5"])
    assert args.config.imma_inner_steps == 5


def test_fields_apply_in_the_library():
    check_fields_apply(["lr", "imma_inner_steps"], ["ours", "imma"])
    with pytest.raises(ParameterError) as e:
        check_fields_apply(["lr", "closed_form_exponent"], ["ours", "imma"])
    assert e.value.parameter == "closed_form_exponent" and "closed_form" in str(e.value)


# --- non-ASCII digits in every numeric flag ----------------------------------------------------------

NUMERIC_TYPES = {"integer", "real", "seeds", "pairs", "number_list"}


def _numeric_flags():
    for mod in SCRIPTS:
        for action in mod.build_parser()._actions:
            if getattr(action.type, "__name__", None) in NUMERIC_TYPES:
                yield mod, action.option_strings[0], action.type.__name__


@pytest.mark.parametrize("mod,flag,kind", list(_numeric_flags()),
                         ids=[f"{m.__name__.split('.')[-1]}:{f}" for m, f, _ in _numeric_flags()])
def test_non_ascii_digits_are_refused(tripwire, capsys, tmp_path, mod, flag, kind):
    """int('١') == 1 and float('١.٥') == 1.5 in Python: --seeds ١ used to run seed 0."""
    value = {"pairs": "٠-١"}.get(kind, "١")
    extra = ["--demo"] if mod is deepnet else []
    rc, err, _ = call(capsys, mod, [*extra, flag, value, "--out", str(tmp_path / "o")])
    assert rc == 2 and one_line(err, flag, "ASCII")


# --- MNIST pairs --------------------------------------------------------------------------------------

def test_repeated_pair_is_refused(tripwire, capsys, tmp_path):
    """--pairs 0-1,0-1 used to count the pair twice in every mean and success count."""
    rc, err, _ = call(capsys, mnist, ["--pairs", "0-1,3-8,0-1", "--out", str(tmp_path / "o")])
    assert rc == 2 and one_line(err, "--pairs", "0-1", "repeated")
    rc, err, _ = call(capsys, attacks, ["--mnist-pairs", "2-5,2-5", "--out", str(tmp_path / "o")])
    assert rc == 2 and one_line(err, "--mnist-pairs", "2-5", "repeated")


# --- zero matrices name the file ------------------------------------------------------------------------

def test_constant_split_names_the_file(capsys, tmp_path, hp_lines):
    """Every D_P row identical: X_P is zero after z-scoring; the message used to be 'X_P is zero: the
    condition number of X_PᵀX_P is undefined', naming neither the file nor the rows."""
    z = _col(hp_lines, "MSZoning")
    P = [line for line in hp_lines[1:] if line.split(",")[z] != "RL"]
    H = [line for line in hp_lines[1:] if line.split(",")[z] == "RL"]
    csv = _write(tmp_path / "flat.csv", [hp_lines[0], *H, *([P[0]] * len(P))])
    rc, err, _ = call(capsys, house_price, ["--data", str(csv), "--seeds", "1", "--methods", "identity",
                                            "--jobs", "1", "--no-plot", "--out", str(tmp_path / "o")])
    assert rc == 1 and one_line(err, str(csv), "D_P", "X_P is zero")


def _write_idx(folder: Path, images: np.ndarray, labels: np.ndarray) -> None:
    n = images.shape[0]
    (folder / "train-images-idx3-ubyte").write_bytes(
        (2051).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in (n, 28, 28))
        + images.astype(np.uint8).tobytes())
    (folder / "train-labels-idx1-ubyte").write_bytes(
        (2049).to_bytes(4, "big") + n.to_bytes(4, "big") + labels.astype(np.uint8).tobytes())


def test_blank_digit_names_the_source_and_the_digit(capsys, tmp_path):
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 30)
    images = rng.integers(0, 256, size=(300, 28, 28))
    images[labels == 3] = 0                                   # every image of digit 3 is blank
    _write_idx(tmp_path, images, labels)
    rc, err, _ = call(capsys, mnist, ["--mnist-dir", str(tmp_path), "--pairs", "3-1", "--seeds", "1",
                                      "--methods", "identity", "--n-train", "10", "--n-heldout", "10",
                                      "--jobs", "1", "--no-plot", "--out", str(tmp_path / "o")])
    assert rc == 1 and one_line(err, str(tmp_path), "digit 3", "blank", "X_P")


def test_library_names_the_zero_product():
    X = np.ones((5, 3))
    with pytest.raises(SpectrumError, match="X_P·theta is zero"):
        from pycore.metrics import rir

        rir(np.zeros((3, 3)), X, X)


# --- Ctrl-C while the script is still importing ---------------------------------------------------------

@pytest.mark.parametrize("script", ["house_price.py", "deepnet.py"])
def test_ctrl_c_during_the_imports_is_one_line(script):
    """SIGINT delivered while NumPy is being imported (deterministic: an import hook sends it) used
    to print a KeyboardInterrupt traceback from deep inside the import machinery."""
    path = str(ROOT / "experiments" / script)
    code = ("import importlib.abc, os, runpy, signal, sys\n"
            "class Trip(importlib.abc.MetaPathFinder):\n"
            "    fired = False\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'numpy' and not Trip.fired:   # one Ctrl-C\n"
            "            Trip.fired = True\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "        return None\n"
            "sys.meta_path.insert(0, Trip())\n"
            f"sys.argv = [{path!r}, '--help']\n"
            f"sys.path.insert(0, {str(ROOT / 'experiments')!r})\n"
            f"runpy.run_path({path!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr.strip() == f"{script}: interrupted (SIGINT)", proc.stderr[-2000:]


def test_module_invocation_installs_the_startup_handler():
    code = ("import sys; sys.argv = ['-m']\nimport signal\nimport experiments\n"
            "print(getattr(signal.getsignal(signal.SIGINT), 'startup_handler', False))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "True", proc.stderr


# --- the library's exceptions cross process boundaries as themselves -------------------------------------

def _exceptions():
    from pycore.deep import CheckpointError, CheckpointMismatchError, DataError, NonFiniteLossError
    from pycore.deep.distributed import DistributedEnvError

    return [ParameterError("lambda_h", "lambda_h too large"), DivergenceError("θ non-finite", parameter="lr"),
            SpectrumError("X_P is zero"), CheckpointError("truncated"), CheckpointMismatchError("shapes"),
            DataError("no images"), DistributedEnvError("RANK unset"),
            NonFiniteLossError("loss is NaN", "lr", step=3, checkpoint="last.safetensors"),
            cli.UsageError("must be ≥ 1", "--jobs"), cli.RunError("a method failed")]


@pytest.mark.parametrize("exc", _exceptions(), ids=lambda e: type(e).__name__)
def test_exceptions_pickle_with_their_attributes(exc):
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc) and back.args == exc.args
    assert back.__dict__ == exc.__dict__


def _raise_in_worker(i):
    if i == 1:
        raise ParameterError("imma_inner_lr", f"imma_inner_lr too large (worker {os.getpid()})")
    time.sleep(0.5)
    return os.getpid()


@pytest.mark.skipif(cli.available_cores() < 2, reason="one core: parallel_map runs serially")
def test_worker_errors_arrive_as_the_library_types():
    with pytest.raises(ParameterError) as e:
        cli.parallel_map(_raise_in_worker, [0, 1], jobs=2, desc="t", unit="t")
    assert e.value.parameter == "imma_inner_lr"
    assert f"(worker {os.getpid()})" not in str(e.value)          # raised in another process
    assert "Traceback" in str(e.value.__cause__)                 # the worker's traceback, for --debug


def test_interrupt_signal_numbers():
    assert cli.EXIT_SIGINT == 128 + signal.SIGINT and cli.EXIT_SIGTERM == 128 + signal.SIGTERM
