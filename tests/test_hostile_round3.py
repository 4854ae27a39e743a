"""The third hostile sweep (issue 34): every defect and misleading answer it found, one case each.

Each test checks behaviour (which argument, file or flag an error names, which value a result
has, what results.json records), never wording; none allocates more than a few MB: a refusal is
shown to come before the allocation by tracemalloc's peak or by the time it takes.
"""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from pycore import (
    LinearTask,
    ParameterError,
    attack_evaluation,
    evaluate_linear,
    harden_result,
    immunize,
    limits,
    rir_ceiling,
)
from tests.helpers import added_peak_rss


def _peak(fn, exc=ValueError):
    """``(the exception fn raised, tracemalloc's peak in bytes while it ran)``."""
    tracemalloc.start()
    try:
        with pytest.raises(exc) as info:
            fn()
        return info.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _task(D, N=6, seed=0, **kw):
    rng = np.random.default_rng(seed)
    return LinearTask(
        rng.normal(size=(N, D)),
        rng.normal(size=N),
        rng.normal(size=(N, D)),
        rng.normal(size=N),
        **kw,
    )


# ---- defect H: the library budgets the D×D work of each method and evaluation ----------------


def test_a_wide_task_is_refused_before_its_dxd_arrays_exist():
    """A 480 KB task of 2 × 30,000 inputs: np.eye alone would take 6.7 GiB."""
    X = np.random.default_rng(0).normal(size=(2, 30_000))
    task = LinearTask(X, [1.0, 2.0], 2 * X, [1.0, 3.0])
    for method in ("ours", "identity", "closed_form", "imma"):
        err, peak = _peak(lambda: immunize(task, method, rng=np.random.default_rng(0)))
        assert "30000" in str(err) and peak < 8 << 20, (method, peak)


@pytest.mark.parametrize(
    "entry",
    [
        lambda t, eye: rir_ceiling(t.X_P, t.X_H),
        lambda t, eye: evaluate_linear(eye, t),
        lambda t, eye: attack_evaluation(eye, t, rng=np.random.default_rng(0)),
        lambda t, eye: immunize(t, "opt_kappa", rng=np.random.default_rng(0)),
    ],
    ids=["rir_ceiling", "evaluate_linear", "attack_evaluation", "opt_kappa"],
)
def test_every_entry_point_checks_its_work_budget(monkeypatch, entry):
    task, eye = _task(300), np.eye(300)
    monkeypatch.setattr(limits, "MAX_WORK_BYTES", 8 * 300 * 300)  # one D×D array
    err, peak = _peak(lambda: entry(task, eye))
    # θ's own float64 copy is the one D×D array that may exist before the check
    assert "300" in str(err) and "MAX_WORK_BYTES" in str(err) and peak < 1.5 * 8 * 300 * 300


def test_hardening_checks_its_work_budget(monkeypatch):
    task = _task(300)
    res = immunize(task, "identity", rng=np.random.default_rng(0))
    monkeypatch.setattr(limits, "MAX_WORK_BYTES", 8 * 300 * 300)
    for kind in ("haar", "equalize"):
        err, peak = _peak(lambda: harden_result(res, task, kind, rng=np.random.default_rng(0)))
        assert "300" in str(err) and peak < 8 * 300 * 300, kind


def test_within_the_budget_nothing_changes():
    task = _task(20, N=30)
    res = immunize(task, "closed_form", rng=np.random.default_rng(0))
    assert np.isfinite(res.rir) and res.theta.shape == (20, 20)


# ---- one's own CSV: what is changed is counted, a split names its flag and its values ---------


def _own_csv(path, n=60, seed=1, *, empty=(3, 10, 11), pid=("1.0", "2.0")):
    """x, y (cells ``empty`` blank), text c, group g, PID stored as floats, target t, 0/1 b."""
    rng = np.random.default_rng(seed)
    lines = ["x,y,c,g,PID,t,b"]
    for i in range(n):
        cells = [
            f"{rng.normal():.6f}",
            "" if i in empty else f"{rng.normal():.6f}",
            "uvw"[i % 3],
            "ab"[i % 2],
            pid[i % 2],
            f"{rng.normal():.6f}",
            str(int(rng.random() > 0.5)),
        ]
        lines.append(",".join(cells))
    path.write_text("\n".join(lines) + "\n")
    return path


def _numeric_csv(path, columns, rows, rng):
    """``columns`` normal inputs c0, c1, …, a group g (a/b alternating) and a normal target t."""
    lines = [",".join(f"c{j}" for j in range(columns)) + ",g,t"]
    for i in range(rows):
        cells = [f"{v:.5f}" for v in rng.normal(size=columns)]
        lines.append(",".join([*cells, "ab"[i % 2], f"{rng.normal():.5f}"]))
    path.write_text("\n".join(lines) + "\n")
    return path


def _run_hp(capsys, argv):
    from experiments import house_price
    from tests.cli_helpers import call

    return call(capsys, house_price, [*argv, "--seeds", "1", "--no-plot", "--jobs", "1"])


def test_changes_to_ones_data_are_counted_printed_and_recorded(capsys, tmp_path):
    from pycore.report import read_json

    csv_path, out = _own_csv(tmp_path / "own.csv"), tmp_path / "out"
    base = ["--data", str(csv_path), "--target-p", "t", "--split", "g=b", "--n-train", "10"]
    rc, err, _ = _run_hp(capsys, [*base, "--methods", "identity", "--out", str(out)])
    assert rc == 0, err
    data = read_json(out / "results.json")["data"]
    assert data["changes"]["missing_cells_filled_with_0"] == {"y": 3}
    assert data["changes"]["dropped_non_numeric_columns"] == ["c"]  # g is the split column
    assert data["changes"]["label_encoded_text_columns"] == []
    # named, the text column is encoded and listed
    argv = [*base, "--inputs", "x,y,c", "--methods", "identity", "--out", str(out)]
    rc, err, _ = _run_hp(capsys, argv)
    assert rc == 0 and read_json(out / "results.json")["data"]["changes"][
        "label_encoded_text_columns"
    ] == ["c"]
    # the printed line (stdout, captured by `call`'s capsys before it reads stderr)
    rc, err, _ = _run_hp(capsys, [*base, "--methods", "identity", "--out", str(out)])
    # refused on demand: the file, column and line
    rc, err, _ = _run_hp(capsys, [*base, "--on-missing", "error", "--out", str(out)])
    from tests.cli_helpers import one_line

    assert rc == 1 and "'y'" in one_line(err, str(csv_path), "line 5")


def test_the_changes_line_is_printed(capsys, tmp_path):
    from experiments import house_price

    csv_path = _own_csv(tmp_path / "own.csv")
    argv = ["--data", str(csv_path), "--target-p", "t", "--split", "g=b", "--n-train", "10"]
    argv += ["--methods", "identity", "--seeds", "1", "--no-plot", "--out", str(tmp_path / "o")]
    assert house_price.main(argv) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if str(csv_path) in line]
    assert any("'y'" in line and "3" in line and "'c'" in line for line in printed), printed


def test_a_small_split_names_the_flag_and_a_float_split_value_matches(capsys, tmp_path):
    from tests.cli_helpers import one_line

    csv_path, out = _own_csv(tmp_path / "own.csv"), str(tmp_path / "out")
    base = ["--data", str(csv_path), "--target-p", "t", "--methods", "identity", "--out", out]
    rc, err, _ = _run_hp(capsys, [*base, "--split", "PID=1"])  # 30 rows per split < 200
    assert rc == 2 and one_line(err, "--n-train")
    rc, err, _ = _run_hp(capsys, [*base, "--split", "PID=1", "--n-train", "10"])
    assert rc == 0, err  # "1" finds the cells stored as "1.0"
    rc, err, _ = _run_hp(capsys, [*base, "--split", "PID=3", "--n-train", "10"])
    assert rc == 2 and one_line(err, "--split", "'1.0'", "'2.0'")  # the values it saw


def test_a_zero_one_target_runs_bce_when_asked_and_says_which_loss_runs(capsys, tmp_path):
    from pycore.data import load_table
    from pycore.report import read_json

    csv_path, out = _own_csv(tmp_path / "own.csv"), tmp_path / "out"
    d = load_table(csv_path, target_p="b", target_h="t", split="g=b", n_train=10, loss="bce")
    assert d.train.loss == "bce" and set(np.unique(d.train.Y_P)) == {0.0, 1.0}
    assert d.binary_target_p and not np.isin(d.train.Y_H, (0.0, 1.0)).all()
    with pytest.raises(ParameterError) as e:  # a continuous target is not a label
        load_table(csv_path, target_p="t", split="g=b", n_train=10, loss="bce")
    assert e.value.parameter == "loss"
    base = ["--data", str(csv_path), "--target-p", "b", "--target-h", "t", "--split", "g=b"]
    base += ["--n-train", "10", "--methods", "identity", "--out", str(out)]
    from experiments import house_price

    assert house_price.main([*base, "--seeds", "1", "--no-plot"]) == 0
    said = capsys.readouterr().out
    assert "--loss" in said and read_json(out / "results.json")["data"]["loss"] == "mse"
    assert house_price.main([*base, "--seeds", "1", "--no-plot", "--loss", "bce"]) == 0
    assert read_json(out / "results.json")["data"]["loss"] == "bce"


def test_a_quoted_line_break_in_a_header_is_a_column_name(tmp_path):
    from pycore.data import load_table

    lines = _own_csv(tmp_path / "a.csv").read_text().splitlines()
    p = tmp_path / "q.csv"
    p.write_text('x,"y\nsecond line",c,g,PID,t,b\n' + "\n".join(lines[1:]) + "\n")
    d = load_table(p, target_p="t", split="g=b", n_train=10)
    assert d.feature_names == ["x", "y\nsecond line", "PID", "b"]


def test_cells_near_1e_310_are_z_scored_not_called_nan(tmp_path):
    """Their squares underflow: the std was 0 and the task "contained NaN or inf"."""
    from pycore.data import load_table

    rng = np.random.default_rng(0)
    x = [float(v) * 1e-310 for v in rng.normal(size=40)]
    p = tmp_path / "tiny.csv"
    p.write_text(
        "x,z,g,t\n"
        + "".join(
            f"{v!r},{rng.normal():.6f},{'ab'[i % 2]},{rng.normal():.6f}\n" for i, v in enumerate(x)
        )
    )
    d = load_table(p, target_p="t", split="g=b", n_train=10)
    got = np.r_[d.train.X_P[:, 0], d.heldout.X_P[:, 0]]
    a = np.array(x[::2]) * 1e300 * 1e10  # D_P: the rows with g = a
    assert np.allclose(got, (a - a.mean()) / a.std(), atol=1e-9)


def test_a_table_whose_methods_exceed_the_budget_is_refused_before_any_run(
    capsys, tmp_path, monkeypatch
):
    from experiments import house_price
    from tests.cli_helpers import one_line

    def boom(*a, **k):
        raise AssertionError("COMPUTED")

    monkeypatch.setattr(house_price, "run_batch", boom)
    monkeypatch.setattr(limits, "MAX_WORK_BYTES", 1 << 20)
    p = _numeric_csv(tmp_path / "wide.csv", 200, 40, np.random.default_rng(0))
    argv = ["--data", str(p), "--target-p", "t", "--split", "g=b", "--n-train", "10"]
    rc, err, _ = _run_hp(capsys, [*argv, "--methods", "ours", "--out", str(tmp_path / "o")])
    assert rc == 1 and one_line(err, "200", "MAX_WORK_BYTES")


# ---- items 1, 2, 9: windows, advice and λ flags that are true -------------------------------


def _near_twins(noise, seed=0):
    """D_H = D_P's rows plus ``noise``: the RIR ceiling is 1 + O(noise)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(60, 6))
    X_H = X + noise * rng.normal(size=X.shape)
    return LinearTask(X, rng.normal(size=60), X_H, rng.normal(size=60))


def test_a_window_whose_width_is_round_off_is_empty():
    """Both tasks of the same rows: κ(C) = 1 + 4e-15 opened a window [2.6e14, 2.6e14 + 1)."""
    from pycore import def31_exponent_window

    same = rir_ceiling(*(lambda t: (t.X_P, t.X_H))(_near_twins(0.0)))
    assert same.kappa_C > 1 and def31_exponent_window(same).empty
    narrow = _near_twins(0.005)
    assert not def31_exponent_window(rir_ceiling(narrow.X_P, narrow.X_H)).empty


def test_algorithm_1_on_a_narrow_window_points_to_what_meets_it():
    """Ceiling 1.007: Adam ends at (i) = (ii) = 1; the advice is the closed form, which meets
    Definition 3.1 on the same task."""
    task = _near_twins(0.005)
    res = immunize(task, "ours", rng=np.random.default_rng(0))
    assert not res.immunized and res.diagnostics["advice"] == "closed_form"
    assert immunize(task, res.diagnostics["advice"], rng=np.random.default_rng(0)).immunized


def test_one_lambda_given_names_that_lambda(capsys, tmp_path):
    from tests.cli_helpers import one_line

    csv_path = _own_csv(tmp_path / "own.csv")
    argv = ["--data", str(csv_path), "--target-p", "t", "--split", "g=b", "--n-train", "10"]
    argv += ["--methods", "ours", "--out", str(tmp_path / "o")]
    for flag, value in (("--lambda-p", "100"), ("--lambda-h", "1e7")):
        rc, err, _ = _run_hp(capsys, [*argv, flag, value])
        assert rc == 2 and flag in one_line(err), err


def test_help_shows_the_defaults_of_ones_own_table(capsys):
    from experiments import house_price

    assert house_price.main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--lambda-p", "--lambda-h", "--exponent"):
        entry = text.split(f" {flag} ", 1)[1].split(" --", 1)[0]
        assert "auto" in entry, (flag, entry)


def test_attack_evaluation_probes_a_continuous_d_h_target_of_a_bce_task_with_squares():
    """LinearTask probes D_H with the squared loss: a BCE task (0/1 D_P labels) with a
    continuous D_H target attacks exactly as its squared-loss twin."""
    rng = np.random.default_rng(0)
    X_P, X_H = rng.normal(size=(40, 5)), rng.normal(size=(30, 5))
    y_P, y_H = (rng.random(40) > 0.5).astype(float), rng.normal(size=30)
    theta = np.eye(5) + 0.3 * rng.normal(size=(5, 5))
    kw = dict(quick=True, max_steps=200)
    bce = attack_evaluation(
        theta, LinearTask(X_P, y_P, X_H, y_H, loss="bce"), rng=np.random.default_rng(1), **kw
    )
    mse = attack_evaluation(
        theta, LinearTask(X_P, y_P, X_H, y_H), rng=np.random.default_rng(1), **kw
    )
    assert bce.loss == mse.loss == "mse"
    assert (bce.worst.steps, bce.worst.reference_steps) == (
        mse.worst.steps,
        mse.worst.reference_steps,
    )
    labels = LinearTask(X_P, y_P, X_H, (y_H > 0).astype(float), loss="bce")
    assert attack_evaluation(theta, labels, rng=np.random.default_rng(1), **kw).loss == "bce"


def test_hardening_is_not_said_to_change_a_loss_that_is_round_off(capsys, tmp_path):
    """10 training rows, 12 inputs: D_P is fit exactly, its best loss ~1e-31 with θ and ~1e-30
    with θQ, once reported as a 358 % change."""
    from pycore.report import read_json

    p = _numeric_csv(tmp_path / "fit.csv", 12, 60, np.random.default_rng(2))
    argv = ["--data", str(p), "--target-p", "t", "--split", "g=b", "--n-train", "10"]
    argv += ["--methods", "identity,closed_form", "--harden", "haar", "--out", str(tmp_path / "o")]
    rc, err, _ = _run_hp(capsys, argv)
    assert rc == 0, err
    runs = [
        r
        for e in read_json(tmp_path / "o" / "results.json")["methods"].values()
        for r in e["runs"]
    ]
    assert max(r["train"]["dp_loss_after"] for r in runs) < 1e-20  # the exact fit of this case
    assert max(r["hardening"]["max_rel_diff_vs_unhardened"] for r in runs) < 1e-8


# ---- outputs: links refused, errors name the output, a closed stderr ----------------------


HP_TINY = ["--seeds", "1", "--methods", "identity", "--probe-steps", "2", "--jobs", "1"]


@pytest.mark.parametrize("target", ["notes.txt", "nowhere/dangling"])
def test_a_symlink_at_an_output_name_is_refused_and_left_alone(capsys, tmp_path, target):
    from experiments import house_price
    from tests.cli_helpers import call, one_line

    out, notes = tmp_path / "out", tmp_path / "notes.txt"
    out.mkdir()
    notes.write_text("my notes")
    (out / "table.md").symlink_to(tmp_path / target)
    rc, err, _ = call(capsys, house_price, [*HP_TINY, "--no-plot", "--out", str(out)])
    assert rc == 2 and one_line(err, "--out", "table.md")
    assert (out / "table.md").is_symlink() and notes.read_text() == "my notes"
    assert not (out / "results.json").exists()


def test_write_outputs_refuses_a_link_before_writing_anything(tmp_path):
    from experiments import common

    (tmp_path / "b.txt").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(common.RunError, match="b.txt"):
        common.write_outputs(tmp_path, {"a.txt": "1", "b.txt": "2"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt"]


def test_a_failed_write_names_the_output_not_its_temporary(capsys, tmp_path, monkeypatch):
    import errno

    from experiments import house_price
    from tests.cli_helpers import call, one_line

    def full_disk(result, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(house_price, "plot_norm_ratio", full_disk)
    out = tmp_path / "out"
    rc, err, _ = call(capsys, house_price, [*HP_TINY, "--out", str(out)])
    line = one_line(err, str(out / "norm_ratio.png"))
    assert rc == 1 and ".norm_ratio." not in line
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # the temporary is gone


def test_a_run_with_stderr_closed_succeeds(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    argv = [sys.executable, str(root / "experiments" / "house_price.py"), *HP_TINY, "--no-plot"]
    argv += ["--out", str(tmp_path / "o")]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = " ".join(f"'{a}'" for a in argv) + " 2>&-"
    out = subprocess.run(
        ["sh", "-c", cmd], capture_output=False, stdout=subprocess.PIPE, env=env, timeout=300
    )
    assert out.returncode == 0 and (tmp_path / "o" / "results.json").exists()


def test_a_batch_too_wide_for_the_default_rank_tolerance_names_rtol():
    """1 × 10⁸ float32: D·eps = 11.9 ≥ 1 cut λ_max itself and the batch was called "zero or
    underflowing"; refused naming rtol, before any product (a stride-0 view: no 400 MB)."""
    import torch

    from pycore import ops

    Z = torch.ones(1, 1).expand(1, 10**8)
    for fn in (ops.cond_regularizer, ops.reference_cond_regularizer):
        with pytest.raises(ops.CondRegError) as e:
            fn(Z, "well")
        assert e.value.parameter == "rtol" and "100000000" in str(e.value)
    # an explicit tolerance reads the same width (on a small batch here: D·eps < 1 is unchanged)
    assert float(ops.cond_regularizer(torch.randn(4, 8, dtype=torch.float64), "well")) > 0


def test_a_gzipped_mnist_file_loads_in_a_small_multiple_of_its_size(tmp_path):
    """600k blank images in a 1.1 MB .gz (470 MB decompressed) took more than 6 GB, 25× the data:
    the file read whole, then astype(float64), / 255 and one mask per digit.  Here 20k images
    (15.7 MB decompressed): the load must add less than 11× that (its float64 copy is 8×)."""
    import gzip

    n = 20_000
    labels = (np.arange(n) % 10).astype(np.uint8)
    with gzip.open(tmp_path / "train-images-idx3-ubyte.gz", "wb") as fh:
        fh.write((2051).to_bytes(4, "big") + b"".join(v.to_bytes(4, "big") for v in (n, 28, 28)))
        fh.write(bytes(n * 784))
    with gzip.open(tmp_path / "train-labels-idx1-ubyte.gz", "wb") as fh:
        fh.write((2049).to_bytes(4, "big") + n.to_bytes(4, "big") + labels.tobytes())
    added, threes = added_peak_rss(
        "from pycore.data.mnist import load_mnist_idx",
        "load_mnist_idx(sys.argv[1]).count(3)",
        str(tmp_path),
    )
    assert int(threes) == n // 10 and added < 11 * n * 784, added / (n * 784)


# ---- deep side: checkpoints, image folders, labels ----------------------------------------


def _evil_checkpoint(path, **kwargs):
    """A few hundred bytes of safetensors whose metadata asks for a timm ViT with ``kwargs``."""
    import json

    import torch
    from pycore.deep.checkpoint import FORMAT
    from safetensors.torch import save_file

    meta = {"format": FORMAT, "model": "vit_tiny_patch16_224", "num_classes": "2"}
    save_file(
        {"net.cls_token": torch.ones(1, 1, 192)},
        path,
        metadata={**meta, "model_kwargs": json.dumps(kwargs)},
    )
    return path


@pytest.mark.parametrize(
    "kwargs",
    [
        {"depth": 100000},
        {"embed_dim": 99999, "num_heads": 3},
        {"img_size": 100000, "patch_size": 1},
    ],
)
def test_checkpoint_metadata_is_checked_against_its_tensors_before_building(tmp_path, kwargs):
    """Each of these asked for 5-120 GB before a tensor was compared."""
    import resource

    from pycore.deep import CheckpointMismatchError, load_model

    path = _evil_checkpoint(tmp_path / "evil.safetensors", **kwargs)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with pytest.raises(CheckpointMismatchError, match="evil.safetensors"):
        load_model(path)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert time.perf_counter() - t0 < 10 and grown < 200 << 20


def test_audit_names_the_flag_of_a_checkpoint_whose_metadata_lies(capsys, tmp_path):
    from experiments import audit
    from tests.cli_helpers import call, one_line

    evil = _evil_checkpoint(tmp_path / "evil.safetensors", depth=100000)
    argv = ["--model", str(evil), "--reference", str(evil), "--out", str(tmp_path / "o")]
    rc, err, seconds = call(capsys, audit, argv)
    assert rc == 2 and one_line(err, "--model", "evil.safetensors") and seconds < 30


def _image_root(root, classes=("a", "b"), n=3, side=16):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            pixels = rng.integers(0, 255, size=(side, side, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / c / f"{i}.png")
    return root


def test_a_named_pipe_called_png_is_refused_not_read(tmp_path):
    """A FIFO x.png in a class folder hung image_folder, audit and deepnet for ever (here an
    alarm ends the wait if the pipe is read)."""
    import os
    import signal
    import types

    from pycore.deep.data import _decode

    from pycore.deep import DataError, image_folder

    _image_root(tmp_path / "dp" / "train")
    fifo = tmp_path / "dp" / "train" / "a" / "x.png"
    os.mkfifo(fifo)
    model = types.SimpleNamespace(pretrained_cfg={"input_size": (3, 16, 16)})  # a data config

    def hung(signum, frame):
        raise TimeoutError("blocked reading the pipe")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        with pytest.raises(DataError, match="x.png"):
            image_folder(tmp_path / "dp", "train", model)
        with pytest.raises(DataError, match="x.png"):  # a pipe put there after the listing
            _decode(str(fifo))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_sigterm_ends_a_run_whose_thread_is_stuck(tmp_path):
    """ "interrupted" was printed and the process lived on until SIGKILL: the interpreter waits
    for every non-daemon thread at exit."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
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
        env={**os.environ, "PYTHONPATH": str(root)},
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "started"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 143
    finally:
        proc.kill()
        proc.wait()


def test_one_huge_label_is_refused_before_a_classifier_is_sized_by_it():
    """One label of 5,000,000 among 16 samples sized a 20.5 GB classifier."""
    import torch

    from pycore.deep import DataError, audit_model, create_model, immunize_model

    model = create_model("resnet10t", 2, seed=0)
    X = torch.randn(16, 3, 32, 32)
    y = torch.arange(16) % 2
    huge = y.clone()
    huge[5] = 5_000_000
    t0 = time.perf_counter()
    with pytest.raises(DataError, match="5000000") as e:
        immunize_model(model, (X, y), (X, huge), epochs=1)
    assert str(e.value).startswith("dh") and "sample 5" in str(e.value)
    with pytest.raises(DataError, match="5000000"):
        audit_model(model, reference=model, dh=(X, huge), operators="gd")
    with pytest.raises(DataError, match="dp"):  # D_P's labels must be the model's classes
        immunize_model(model, (X, y + 1), (X, y), epochs=1)
    assert time.perf_counter() - t0 < 30


def _deep_roots(tmp_path, side=16, dp_split="train"):
    for root, split in (("dp", dp_split), ("dp", "val"), ("dh", "train"), ("dh", "val")):
        _image_root(tmp_path / root / split, side=side)
    return ["--dp-root", str(tmp_path / "dp"), "--dh-root", str(tmp_path / "dh")]


def _no_compute(monkeypatch):
    from experiments import deepnet

    def boom(*a, **k):
        raise AssertionError("COMPUTED")

    monkeypatch.setattr(deepnet, "run_configs", boom)


def test_a_root_without_train_names_the_layout(capsys, tmp_path, monkeypatch):
    from experiments import deepnet
    from tests.cli_helpers import call, one_line

    _no_compute(monkeypatch)
    argv = [*_deep_roots(tmp_path, dp_split="training"), "--theta0-epochs", "1"]
    rc, err, _ = call(capsys, deepnet, [*argv, "--out", str(tmp_path / "o")])
    assert rc == 2 and one_line(err, "--dp-root", "train/", "training/")
    assert deepnet.main(["--help"]) == 0
    assert "/train/" in capsys.readouterr().out  # --help names the layout


def test_a_model_too_small_for_the_images_asks_for_img_size(capsys, tmp_path, monkeypatch):
    """convnext_atto on 28-px images: a RuntimeError from its padding, with no hint."""
    from experiments import deepnet
    from tests.cli_helpers import call, one_line

    _no_compute(monkeypatch)
    argv = [*_deep_roots(tmp_path, side=28), "--model", "convnext_atto", "--theta0-epochs", "1"]
    rc, err, _ = call(capsys, deepnet, [*argv, "--out", str(tmp_path / "o")])
    assert rc == 2 and one_line(err, "--img-size", "convnext_atto")


def test_a_huge_img_size_is_said_and_threads_are_capped(capsys, tmp_path, monkeypatch):
    from experiments import common, deepnet

    _no_compute(monkeypatch)
    argv = [*_deep_roots(tmp_path), "--theta0-epochs", "1", "--img-size", "4096"]
    rc = deepnet.main([*argv, "--threads", "1024", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 1 and "COMPUTED" in err  # the run went on, after the warnings
    warned = [line for line in err.splitlines() if "warning" in line]
    assert any("--img-size" in line and "4096" in line for line in warned), err
    assert any("--threads" in line for line in warned), err
    assert common.thread_count(1024, "x") == common.usable_cores()


def test_theta0_near_chance_is_flagged_by_its_majority_class_and_source():
    """90 % of D_P in one class: a θ₀ at 91 % learned nothing, yet 1/classes called it fine; and
    the advice to pass --checkpoint went to runs that had passed one."""
    from argparse import Namespace

    from experiments.deepnet import theta0_warning

    def result(*accs, chance=90.0):
        seeds = [
            {"seed": s, "theta0": {"dp_top1": a}, "classes": [2, 2], "dp_chance": chance}
            for s, a in enumerate(accs)
        ]
        return {"per_seed": seeds}

    plain = Namespace(checkpoint=None, pretrained=False)
    assert [s["seed"] for s in theta0_warning(result(99.0, 91.0), plain)["seeds"]] == [1]
    assert theta0_warning(result(97.0, 98.0), plain) is None
    given = Namespace(checkpoint="theta0.safetensors", pretrained=False)
    message = theta0_warning(result(91.0), given)["message"]
    assert "theta0.safetensors" in message and "pass --checkpoint" not in message


def test_levit_distilled_heads_are_one_linear_head_with_the_same_logits(tmp_path):
    """LeViT's classifier is a pair of BatchNorm + Linear heads on the same pre-logits: folded
    into the one linear head the layer feeds, its logits are the model's own; a DeiT distilled
    pair (two tokens) is refused naming the model."""
    import torch
    from pycore.deep.models import as_immunized

    from pycore import ParameterError
    from pycore.deep import create_model, load_model, save_model

    net = create_model("levit_128s", 3, seed=0, img_size=64).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = net(x)
        wrapped = as_immunized(net).eval()
        assert isinstance(wrapped.classifier, torch.nn.Linear)
        torch.testing.assert_close(wrapped(x), own, rtol=1e-5, atol=1e-5)
        path = save_model(wrapped, tmp_path / "levit.safetensors")
        torch.testing.assert_close(load_model(path)[0](x), own, rtol=1e-5, atol=1e-5)
        torch.save(net.state_dict(), tmp_path / "plain.pt")  # timm's own keys
        plain = load_model(tmp_path / "plain.pt", "levit_128s", img_size=64)[0]
        torch.testing.assert_close(plain(x), own, rtol=1e-5, atol=1e-5)
    with pytest.raises(ParameterError) as e:
        as_immunized(create_model("deit_tiny_distilled_patch16_224", 2, seed=0))
    assert e.value.parameter == "model"
