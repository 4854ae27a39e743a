"""MNIST: data loading (broken and oversized files named, bounded memory), pair tasks, the fast
N < D paths of the immunizer, and a CI-sized run of ``experiments/mnist.py``."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg

from pycore import LinearTask, ParameterError, immunize_batch, limits
from pycore._imma import IMMAOptions, imma_objective
from pycore._precondition import G_parts, Preconditioner, precondition, theta_G
from pycore.data import MnistDigits, pair_task, split_digits
from pycore.data._mnist import ink_targets, load_mnist_5k, load_mnist_idx, parse_pairs
from pycore.linalg import hessian_regularizer
from pycore.report import read_json
from tests.helpers import added_peak_rss, fifo

ROOT = Path(__file__).resolve().parents[1]


def _low_rank_rows(rng, n=40, D=90, rank=30, zero_cols=12):
    """N < D rows of rank < N with always-zero columns, like MNIST's border pixels."""
    X = rng.standard_normal((n, rank)) @ rng.standard_normal((rank, D))
    X[:, :zero_cols] = 0.0
    return X


def _mse(X, theta, w, Y):
    """‖Xθw − Y‖²/(N·m): the D_H loss of docs/theory.md §1."""
    return float(np.mean((X @ theta @ w - Y) ** 2))


def _bce(X, theta, omega, Y, bias):
    """The mean binary cross-entropy of the logits Xθω + bias against Y ∈ {0, 1}."""
    z = X @ theta @ omega + bias
    return float(np.mean(np.logaddexp(0.0, z) - Y * z))


def _reference_regularizer(Z, kind):
    """The D×D route written out: eigh of H = ZᵀZ, G = σ₁v₁v₁ᵀ − H/D or (σ_kv_kv_kᵀ − H/k)/d²."""
    H = Z.T @ Z
    lam, V = scipy.linalg.eigh(H)  # not numpy's: the code under test uses numpy on ZZᵀ
    lam, V = lam[::-1], V[:, ::-1]
    D = H.shape[0]
    k = int(np.sum(lam > lam[0] * D * np.finfo(float).eps))
    if kind == "well":
        return H, lam[0] * np.outer(V[:, 0], V[:, 0]) - H / D, lam, k
    d = np.sum(lam[:k] ** 2) / (2 * k) - 0.5 * lam[k - 1] ** 2
    return H, (lam[k - 1] * np.outer(V[:, k - 1], V[:, k - 1]) - H / k) / d**2, lam, k


@pytest.mark.parametrize("kind", ["well", "ill"])
def test_gram_path_matches_dxd_path(kind):
    rng = np.random.default_rng(3)
    Z = _low_rank_rows(rng)
    H, G_ref, lam, k = _reference_regularizer(Z, kind)
    reg = hessian_regularizer(Z, kind)  # N < D: Gram route
    assert reg.info.rank == k
    np.testing.assert_allclose(reg.info.sigma[:k], lam[:k], rtol=1e-10)
    scale = np.abs(G_ref).max()
    assert np.abs(reg.G - G_ref).max() <= 1e-10 * scale
    lean = hessian_regularizer(Z, kind, matrices=False)
    assert lean.G is None and lean.H is None and lean.value == pytest.approx(reg.value, rel=1e-12)


@pytest.mark.parametrize("kind", ["well", "ill"])
def test_theta_G_and_pinv_direction_through_Z(kind):
    rng = np.random.default_rng(4)
    X = _low_rank_rows(rng)
    D = X.shape[1]
    theta = np.eye(D) + 0.1 * rng.standard_normal((D, D))
    Z = X @ theta
    reg = hessian_regularizer(Z, kind)
    lean = hessian_regularizer(Z, kind, matrices=False)
    ref_TG = theta @ reg.G
    assert np.abs(theta_G(theta, lean, Z) - ref_TG).max() <= 1e-10 * np.abs(ref_TG).max()
    K = X.T @ X
    ref = precondition(theta, reg.G, K, "pinv")
    got = Preconditioner(K, "pinv", 0.0, X).direction(theta, lean, Z)
    assert np.abs(got - ref).max() <= 1e-10 * np.abs(ref).max()
    a, b, v = G_parts(lean, D)
    assert a > 0 and b > 0 and v.shape == (D,)


def test_imma_objective_matches_explicit_unroll():
    rng = np.random.default_rng(5)
    X_P, X_H = _low_rank_rows(rng, n=30, D=40, rank=20), _low_rank_rows(rng, n=30, D=40, rank=25)
    task = LinearTask(X_P, ink_targets(X_P), X_H, rng.standard_normal((30, 1)), loss="bce")
    cfg = IMMAOptions(inner_steps=3)
    theta = np.eye(40) + 0.05 * rng.standard_normal((40, 40))
    w, omega = rng.standard_normal((40, 1)) / 7, rng.standard_normal((40, 1)) / 7
    F, gF = imma_objective(theta, w, omega, task, cfg, 0.1)
    # Explicit D³ unroll with M = wwᵀ, and its gradient by central differences along a direction.
    # the attacker's step inner_lr/L, L = (2/N)λ_max(K_H)‖w‖² (docs/theory.md §7), times 2/N
    n = task.Y_H.size
    c = cfg.inner_lr / (2.0 / n * np.linalg.norm(X_H, 2) ** 2 * np.sum(w * w)) * 2.0 / n
    M, B = w @ w.T, X_H.T @ (task.Y_H @ w.T)

    def f(th):
        for _ in range(3):
            th = th - c * (task.K_H @ th @ M - B)
        return _mse(X_H, th, w, task.Y_H) - _bce(X_P, th, omega, task.Y_P, 0.1)

    assert F == pytest.approx(f(theta), rel=1e-12)
    E = rng.standard_normal((40, 40))
    h = 1e-6
    fd = (f(theta + h * E) - f(theta - h * E)) / (2 * h)
    assert np.sum(gF * E) == pytest.approx(fd, rel=1e-6)


def test_mnist_5k_loader():
    d = load_mnist_5k()
    assert all(d.count(k) == 500 for k in range(10))
    X = d.by_digit[3]
    assert X.shape == (500, 784) and X.dtype == np.float64
    assert X.min() == 0.0 and X.max() <= 1.0 and X.max() > 0.9
    assert np.sum(np.all(X == 0, axis=0)) > 0  # always-zero pixels: K is rank-deficient


def _write_idx(path, arr, magic, gz):
    header = magic.to_bytes(4, "big") + b"".join(int(n).to_bytes(4, "big") for n in arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    (gzip.open if gz else open)(path, "wb").write(data)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_loader_round_trip(tmp_path, gz):
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 3)
    images = rng.integers(0, 256, size=(30, 28, 28))
    sfx = ".gz" if gz else ""
    _write_idx(tmp_path / f"train-images-idx3-ubyte{sfx}", images, 2051, gz)
    _write_idx(tmp_path / f"train-labels-idx1-ubyte{sfx}", labels, 2049, gz)
    d = load_mnist_idx(tmp_path)
    np.testing.assert_array_equal(d.by_digit[7], images[labels == 7].reshape(-1, 784) / 255.0)


def test_idx_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        load_mnist_idx(tmp_path)
    # wrong magic
    _write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((2, 28, 28)), 2049, False)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(2), 2049, False)
    with pytest.raises(ValueError, match="magic"):
        load_mnist_idx(tmp_path)


def _idx_images(n=20) -> bytes:
    return (
        (2051).to_bytes(4, "big")
        + b"".join(d.to_bytes(4, "big") for d in (n, 28, 28))
        + bytes(n * 784)
    )


@pytest.mark.parametrize(
    "case", ["fifo", "dev_zero", "truncated_gzip", "gzip_bomb", "truncated_header"]
)
def test_a_broken_idx_file_is_refused_naming_the_file(tmp_path, monkeypatch, case):
    name = "train-images-idx3-ubyte" + (".gz" if "gzip" in case else "")
    if case == "fifo":
        fifo(tmp_path / name)
    elif case == "dev_zero":
        if not os.path.exists("/dev/zero"):
            pytest.skip("no /dev/zero")
        os.symlink("/dev/zero", tmp_path / name)
    else:
        (tmp_path / name).write_bytes(
            {
                "truncated_gzip": gzip.compress(_idx_images())[:300],
                "gzip_bomb": gzip.compress(_idx_images(50)),  # inflates to 39 kB
                "truncated_header": _idx_images()[:8],
            }[case]
        )
    monkeypatch.setattr(limits, "MAX_DATA_FILE_BYTES", 10_000)
    with pytest.raises(ValueError, match=name):
        load_mnist_idx(tmp_path)


def test_a_gzipped_idx_file_loads_in_a_small_multiple_of_its_size(tmp_path):
    """20k blank images (15.7 MB decompressed) in a small .gz: the load adds less than 11× the
    decompressed data to the peak RSS (its float64 copy is 8×; reading the file whole, then
    astype(float64), / 255 and one mask per digit took 25×)."""
    n = 20_000
    labels = (np.arange(n) % 10).astype(np.uint8)
    with gzip.open(tmp_path / "train-images-idx3-ubyte.gz", "wb") as fh:
        fh.write((2051).to_bytes(4, "big") + b"".join(v.to_bytes(4, "big") for v in (n, 28, 28)))
        fh.write(bytes(n * 784))
    with gzip.open(tmp_path / "train-labels-idx1-ubyte.gz", "wb") as fh:
        fh.write((2049).to_bytes(4, "big") + n.to_bytes(4, "big") + labels.tobytes())
    added, threes = added_peak_rss(
        "from pycore.data._mnist import load_mnist_idx",
        "load_mnist_idx(sys.argv[1]).count(3)",
        str(tmp_path),
    )
    assert int(threes) == n // 10 and added < 11 * n * 784, added / (n * 784)


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(n_train=float("nan")), "n_train"),
        (dict(n_train=8), "n_train"),
        (dict(n_train=2, n_heldout=-1), "n_heldout"),
    ],
)
def test_split_digits_names_a_bad_size(kw, param):
    digits = MnistDigits(
        {d: np.random.default_rng(d).uniform(0, 1, size=(8, 784)) for d in range(10)}, "s"
    )
    with pytest.raises(ParameterError) as e:
        split_digits(digits, rng=np.random.default_rng(0), **kw)
    assert e.value.parameter == param


def test_parse_pairs():
    assert len(parse_pairs("all")) == 90 and (3, 3) not in parse_pairs(None)
    assert parse_pairs("0-1, 3-8") == [(0, 1), (3, 8)]
    for bad in ("0-0", "1-12", "a-b", ""):
        with pytest.raises(ValueError):
            parse_pairs(bad)


def test_pair_tasks_balanced_disjoint_and_shared():
    d = load_mnist_5k()
    sp = split_digits(d, 50, np.random.default_rng(1), n_heldout=30)
    t01, t02 = pair_task(d, sp, 0, 1), pair_task(d, sp, 0, 2)
    held = pair_task(d, sp, 0, 1, heldout=True)
    assert t01.X_P.shape == t01.X_H.shape == (50, 784) and held.X_P.shape == (30, 784)
    assert not set(sp.train[0]) & set(sp.heldout[0])
    np.testing.assert_array_equal(t01.X_P, t02.X_P)  # digit 0's rows shared by its pairs
    np.testing.assert_array_equal(t01.K_P, t02.K_P)  # ... and so is its covariance
    np.testing.assert_allclose(t01.K_H, t01.X_H.T @ t01.X_H, rtol=1e-12, atol=1e-12)
    assert t01.loss == "bce" and t01.Y_P.mean() == pytest.approx(0.5)  # balanced BCE targets
    with pytest.raises(ValueError, match="n_train"):
        split_digits(d, 500, np.random.default_rng(0))


def test_experiment_ci_run(capsys, tmp_path):
    from experiments import mnist as exp

    out = tmp_path / "mn"
    assert (
        exp.main(
            [
                "--pairs",
                "0-1,7-2",
                "--seeds",
                "2",
                "--epochs",
                "2",
                "--n-train",
                "40",
                "--n-heldout",
                "20",
                "--methods",
                "identity,ours,closed_form",
                "--jobs",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    res = read_json(out / "results.json")
    assert list(res["methods"]) == ["identity", "ours", "closed_form"]
    for e in res["methods"].values():
        assert len(e["runs"]) == 4 and e["n_pairs"] == 2
        assert all(
            np.isfinite(r["rir"]) and r["rir"] > 0 and 0 <= r["dp_acc_after"] <= 1
            for r in e["runs"]
        )
    ident, cf = res["methods"]["identity"], res["methods"]["closed_form"]
    assert all(r["rir"] == pytest.approx(1.0) for r in ident["runs"])
    assert ident["successes_rir"] == 0 and ident["successes_def31"] == 0
    assert ident["heldout_rir_null_part"]["mean"] == pytest.approx(1.0)
    assert cf["fraction_of_ceiling"]["mean"] == pytest.approx(1.0, rel=1e-6)
    assert cf["successes_rir"] == 2 and cf["successes_def31"] == 2 and cf["def31_runs"] == 4
    assert (out / "heatmap.png").stat().st_size > 10_000
    grid = exp.rir_grid(res["methods"]["ours"])
    assert np.isfinite(grid[0, 1]) and np.isfinite(grid[7, 2]) and np.isnan(grid[1, 0])
    # the paper's counts are over all 90 pairs: beside 2 pairs they are not printed
    table = exp.table_markdown(res).splitlines()
    header = [c.strip() for c in next(x for x in table if x.startswith("| method")).split("|")]
    ours = [c.strip() for c in next(x for x in table if x.startswith("| Ours")).split("|")]
    assert (
        ours[header.index("paper Def. 3.1")] == "—" and ours[header.index("paper RIR > 1")] == "—"
    )
    res["pairs"] = [[p, h] for p in range(10) for h in range(10) if p != h]
    ours = next(x for x in exp.table_markdown(res).splitlines() if x.startswith("| Ours")).split(
        "|"
    )
    assert ours[header.index("paper Def. 3.1")].strip() == "90/90"
    capsys.readouterr()


def test_success_counts_use_pair_seed_means_and_both_criteria():
    """Def. 3.1 ((i) > 1 AND (ii) < 1) and RIR > 1 are different counts, both on a pair's seed
    means."""
    from experiments import mnist as exp

    def run(pair, i, ii):
        return {"pair": list(pair), "harmful_ratio": i, "pretrain_ratio": ii, "rir": i / ii}

    # fails both
    runs = [
        run((0, 1), 4.0, 2.0),
        run((0, 1), 6.0, 2.0),  # RIR 2, 3 but (ii) > 1: not Def. 3.1
        run((1, 0), 0.5, 0.1),
        run((1, 0), 0.7, 0.1),  # RIR > 1 but (i) < 1: not Def. 3.1
        run((2, 3), 3.0, 0.5),
        run((2, 3), 0.9, 0.5),  # one run fails (i); seed means 1.95, 0.5
        run((3, 2), 0.5, 2.0),
        run((3, 2), 0.9, 2.0),
    ]
    c = exp.success_counts(runs)
    assert c["successes_def31"] == 1 and c["successes_rir"] == 3 and c["def31_runs"] == 1
    assert c["n_pairs"] == 4 and c["pair_mean_harmful_ratio"]["2-3"] == pytest.approx(1.95)
    assert c["pair_mean_rir"]["0-1"] == pytest.approx(2.5)


@pytest.mark.parametrize("loss", ["bce", "mse"])
def test_the_full_batch_loss_through_the_features_is_the_loss_of_the_rows(loss):
    """The loops' full-batch D_P loss goes through the small-side features ``F = Aθ`` (``Xθω =
    U(Fω)``): the first epoch's loss, taken there before the first step, equals the loss recorded
    at the start from ``Xθω``, for every run of a stack (each from its own random θ)."""
    rng = np.random.default_rng(6)
    X = _low_rank_rows(rng, n=30, D=40)
    Y = ink_targets(X)
    task = LinearTask(X, Y, X, Y, loss=loss)
    rngs = [np.random.default_rng(s) for s in range(3)]
    runs = immunize_batch(task, "opt_kappa", rngs=rngs, epochs=1, batch_size=None, init="random")
    starts = [r.history["loss_P"][0] for r in runs]
    assert len(set(starts)) == 3  # three different runs
    for r in runs:
        at_start, first_epoch = r.history["loss_P"][:2]
        assert first_epoch == pytest.approx(at_start, rel=1e-13)
