"""The public linear API: README's library section runs, the public names and the namespaces they
are documented under, per-method options and presets, results carry Definition 3.1,
evaluate_linear refuses what does not belong together, the errors cross process boundaries."""

from __future__ import annotations

import inspect
import json
import os
import pickle
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

import pycore
from pycore import (
    METHODS,
    PRESETS,
    DivergenceError,
    EvaluationReference,
    LinearTask,
    ParameterError,
    SpectrumError,
    def31_exponent_window,
    evaluate_linear,
    immunize,
    immunize_certified,
    immunized_def31,
    options_of,
    rir,
    rir_ceiling,
    strict_protocol,
)
from pycore._closed_form import auto_exponent
from pycore._immunization import resolve_options
from pycore.data import load_house_price

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = json.loads(
    (ROOT / "tests" / "data" / "preset_reference.json").read_text(encoding="utf-8")
)
# option names of the code before the options API → today's
RENAMED = {
    "imma_inner_steps": "inner_steps",
    "imma_inner_lr": "inner_lr",
    "opt_kappa_log": "log",
    "closed_form_exponent": "exponent",
    "certified_safety": "safety",
}


def pair(seed, N=60, D=6, scale=1.0):
    rng = np.random.default_rng(seed)
    X_P = scale * rng.standard_normal((N, D)) * np.geomspace(1, 0.05, D)
    X_H = scale * rng.standard_normal((N, D)) @ rng.standard_normal((D, D))
    return LinearTask(X_P, rng.standard_normal(N), X_H, rng.standard_normal(N))


# the README's examples in a fresh interpreter, as a new user runs them (nothing imported before)
_README_RUNNER = """
import json, sys, warnings
import numpy as np
scope = {}
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    for source in json.loads(sys.stdin.read()):
        exec(compile(source, "README.md (library section)", "exec"), scope)
adam, audit, out = scope["audit"]["adam"], scope["audit"], scope["out"]
print(json.dumps({
    "warnings": sorted({type(w.message).__name__ for w in said}),
    "immunized": scope["res"].immunized,
    "finite": bool(np.isfinite([
        scope["res"].rir, scope["ev"].train.rir, out.harmful_ratio, out.pretrain_ratio
    ]).all()),
    "dp_loss_after": scope["ev"].train.dp_loss_after,
    "slowdown": scope["attack"].worst.slowdown,
    "adam": [adam.flops, adam.cost.setup, audit.worth.worth],
}))
"""


def test_readme_library_section_runs_as_written():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## The library\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "README.md's library section lost a python block"
    proc = subprocess.run(
        [sys.executable, "-c", _README_RUNNER],
        input=json.dumps(blocks),
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    # what the examples print beside their results, the section says (and why)
    assert set(got["warnings"]) <= set(re.findall(r"`(\w+Warning)`", section))
    assert isinstance(got["immunized"], bool) and got["finite"] and got["dp_loss_after"] >= 0
    assert got["slowdown"] > 0 and min(got["adam"]) > 0


def test_public_names():
    import importlib
    import types

    # the entry points keep their names; the public surface stays small, each name once
    entry = {"LinearTask", "immunize", "evaluate_linear", "attack_evaluation"}
    assert entry <= set(pycore.__all__) and len(set(pycore.__all__)) == len(pycore.__all__) <= 40
    # one name, one meaning: pycore.immunize is the function, no module of that name
    assert callable(pycore.immunize) and not isinstance(pycore.immunize, types.ModuleType)
    for name in pycore.__all__:
        assert not isinstance(getattr(pycore, name), types.ModuleType), name
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("pycore.immunize")
    assert set(METHODS) == {
        "identity",
        "r_ill_only",
        "imma",
        "opt_kappa",
        "opt_kappa_balanced",
        "ours",
        "closed_form",
    }
    assert [f.name for f in fields(options_of("identity"))] == []


def _public_modules() -> list[str]:
    """Every module of the package no part of whose dotted name starts with an underscore."""
    import pkgutil

    return ["pycore"] + [
        m.name
        for m in pkgutil.walk_packages(pycore.__path__, "pycore.")
        if not any(part.startswith("_") for part in m.name.split("."))
    ]


def test_the_whole_package_shows_at_most_120_public_names():
    """Every name without a leading underscore that a public module defines or imports counts,
    whether its ``__all__`` lists it or not (a public submodule is counted as a module, not as a
    name of its parent); each public module shows only what its ``__all__`` lists."""
    import importlib
    import types

    modules = _public_modules()
    assert {"pycore", "pycore.attacks", "pycore.data", "pycore.deep", "pycore.ops"} <= set(modules)
    total = 0
    for space in modules:
        module = importlib.import_module(space)
        shown = {
            name
            for name, obj in vars(module).items()
            if not name.startswith("_")
            and not (isinstance(obj, types.ModuleType) and obj.__name__ in modules)
        }
        assert shown == set(module.__all__), (space, sorted(shown ^ set(module.__all__)))
        total += len(shown)
    assert total <= 120
    import pycore.deep

    assert len(set(pycore.deep.__all__)) == len(pycore.deep.__all__) <= 30
    entry = {"immunize_model", "audit_model", "create_model", "load_model", "save_model"}
    assert entry <= set(pycore.deep.__all__)


@pytest.mark.parametrize(
    "space",
    [
        "pycore",
        "pycore.attacks",
        "pycore.linalg",
        "pycore.report",
        "pycore.data",
        "pycore.ops",
        "pycore.deep",
    ],
)
def test_public_classes_and_functions_name_the_namespace_they_are_imported_from(space):
    """Reprs, tracebacks and pickles name the documented path (``pycore.ParameterError``), not the
    private module that defines the object."""
    import importlib

    module = importlib.import_module(space)
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert (obj.__module__, obj.__qualname__) == (space, name), name
            assert pickle.loads(pickle.dumps(obj)) is obj, name


# ---------------------------------------------------------------- options


@pytest.mark.parametrize(
    "method,kw,name",
    [
        ("ours", {"inner_steps": 3}, "inner_steps"),  # an option of another method
        ("ours", {"config": {"epochs": 5}}, "config"),  # a dict where keywords are expected
        ("closed_form", {"epochs": 5}, "epochs"),
        ("identity", {"lr": 0.1}, "lr"),
        ("imma", {"inner_steps": 2.5}, "inner_steps"),  # wrong type
        ("imma", {"inner_lr": 2.0}, "inner_lr"),  # out of range
        ("ours", {"optimizer": "sgd"}, "optimizer"),
        ("ours", {"precond": "ridge", "ridge": 0.0}, "ridge"),
        ("closed_form", {"exponent": "balanced"}, "exponent"),
        ("ours", {"preset": "nonsense"}, "preset"),
    ],
)
def test_a_bad_option_names_itself(method, kw, name):
    with pytest.raises(ParameterError) as e:
        immunize(pair(0), method, rng=np.random.default_rng(0), **kw)
    assert e.value.parameter == name


def test_an_unknown_option_is_refused_before_any_compute_and_names_the_method():
    with pytest.raises(ParameterError) as e:
        resolve_options("imma", epochs=3, lambda_h=1.0)
    assert (
        e.value.parameter == "lambda_h"
        and "imma" in str(e.value)
        and "inner_steps" in str(e.value)
    )


@pytest.mark.parametrize("bad,name", [("magic", "method"), (None, "method")])
def test_unknown_method(bad, name):
    with pytest.raises(ParameterError) as e:
        immunize(pair(0), bad, rng=np.random.default_rng(0))
    assert e.value.parameter == name


def test_rng_and_task_must_be_what_they_say():
    with pytest.raises(ParameterError) as e:
        immunize(pair(0), "identity", rng=0)
    assert e.value.parameter == "rng"
    with pytest.raises(ParameterError) as e:
        immunize((np.eye(3),) * 4, "identity", rng=np.random.default_rng(0))
    assert e.value.parameter == "task"


def test_certified_mode_needs_a_k_inverse_preconditioner():
    with pytest.raises(ParameterError) as e:
        immunize_certified(
            pair(0), rng=np.random.default_rng(0), preset="house_price", precond="none"
        )
    assert e.value.parameter == "precond"


@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_are_the_settings_of_the_code_before_the_options_api(preset):
    """Every option of every method under a preset equals the old configuration's field."""
    old = {RENAMED.get(k, k): v for k, v in REFERENCE["presets"][preset].items()}
    old["betas"] = tuple(old["betas"])
    if preset == "strict":  # the strict table's closed form used the balanced exponent (below)
        assert PRESETS[preset]["exponent"] == "auto"
        old["exponent"] = "auto"
    for m in METHODS:
        opts = resolve_options(m, preset)
        for f in fields(opts):
            # the adaptive default's own option, not in the old configuration
            if f.name != "patience":
                assert getattr(opts, f.name) == old[f.name], (m, f.name)
    opts = resolve_options("ours", preset, lr=0.123)  # explicit keywords win
    assert opts.lr == 0.123 and opts.lambda_h == old["lambda_h"]


@pytest.fixture(scope="module")
def house_prices():
    d = load_house_price()
    return {"paper": d.train, "strict": strict_protocol(d.train, d.heldout, d.feature_names)[0]}


@pytest.mark.parametrize("preset", ["house_price", "paper", "strict"])
def test_presets_reproduce_the_reference_thetas(house_prices, preset):
    """θ after 2 epochs (seed 0) against the code before the options API: sums of θ, θ², |θ|.
    rtol 1e-6: far above round-off across BLAS kernels (~1e-12 after two steps), far below the
    change of any preset value (a wrong lr or λ moves θ by ≥ 1e-3 relative).  The full runs are
    compared bit for bit by the documented tables (tests/test_readme_numbers.py)."""
    task = house_prices["strict" if preset == "strict" else "paper"]
    for m in METHODS:
        kw = {} if m in ("identity", "closed_form") else {"epochs": 2}
        th = immunize(task, m, rng=np.random.default_rng(0), preset=preset, **kw).theta
        got = [np.sum(th), np.sum(th * th), np.sum(np.abs(th))]
        np.testing.assert_allclose(got, REFERENCE["thetas"][f"{preset}/{m}"], rtol=1e-6, err_msg=m)


def test_mnist_presets_reproduce_the_reference_thetas():
    from pycore.data import pair_task, split_digits
    from pycore.data._mnist import load_mnist_5k

    digits = load_mnist_5k()
    task = pair_task(digits, split_digits(digits, 20, np.random.default_rng(0), 10), 0, 1)
    for preset in ("mnist", "mnist_paper"):
        for m in ("ours", "imma", "r_ill_only"):
            th = immunize(task, m, rng=np.random.default_rng(0), preset=preset, epochs=2).theta
            got = [np.sum(th), np.sum(th * th), np.sum(np.abs(th))]
            np.testing.assert_allclose(
                got, REFERENCE["thetas"][f"{preset}/{m}"], rtol=1e-6, err_msg=m
            )


# ---------------------------------------------------------------- results and the closed form


@pytest.mark.parametrize("method", METHODS)
def test_result_reports_definition_31_of_its_theta(method):
    t = pair(3)
    res = immunize(
        t,
        method,
        rng=np.random.default_rng(0),
        **({} if method in ("identity", "closed_form") else {"epochs": 3}),
    )
    r = rir(res.theta, t.X_P, t.X_H)
    # the run's own end-of-run SVDs (QR first for R_ill only and IMMA): equal to round-off
    np.testing.assert_allclose(
        [res.harmful_ratio, res.pretrain_ratio, res.rir],
        [r.harmful_ratio, r.pretrain_ratio, r.value],
        rtol=1e-10,
    )
    assert res.immunized is immunized_def31(r.harmful_ratio, r.pretrain_ratio)
    assert isinstance(res.options, options_of(method)) and res.reason and res.wall_seconds >= 0


@pytest.mark.parametrize("seed", range(6))
def test_closed_form_auto_exponent_is_inside_the_window_and_immunizes(seed):
    t = pair(seed, N=40 + 10 * seed, D=4 + seed)
    c = rir_ceiling(t.X_P, t.X_H)
    w = def31_exponent_window(c)
    res = immunize(t, "closed_form", rng=np.random.default_rng(0))
    a = res.diagnostics["exponent"]
    if w.empty:
        assert a == 0.0 and not res.immunized
    else:
        assert w.low <= a < w.high and res.immunized
        assert res.rir == pytest.approx(c.range_restricted, rel=1e-8)
        if w.balanced >= 0:  # the middle of the window: (i) = 1/(ii) = √ceiling
            assert res.harmful_ratio == pytest.approx(1 / res.pretrain_ratio, rel=1e-6)


def test_closed_form_auto_is_the_strict_tables_exponent(house_prices):
    """The strict protocol's table used max(balanced, 0): "auto" gives exactly that number."""
    t = house_prices["strict"]
    a, _ = auto_exponent(t)
    assert a == max(def31_exponent_window(rir_ceiling(t.X_P, t.X_H)).balanced, 0.0)
    assert immunize(t, "closed_form", rng=np.random.default_rng(0)).diagnostics["exponent"] == a


def test_closed_form_says_why_definition_31_is_out_of_reach():
    """D_H a copy of D_P: C = I, κ(C) = 1, every exponent gives (i) = (ii) = 1."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((30, 4))
    res = immunize(LinearTask(X, np.ones(30), X, np.ones(30)), "closed_form", rng=rng)
    assert res.diagnostics["exponent"] == 0.0 and not res.immunized
    res = immunize(pair(1), "closed_form", rng=rng, exponent=0.25)  # a number is used as given
    assert res.diagnostics["exponent"] == 0.25


# ---------------------------------------------------------------- evaluate_linear and LinearTask


def test_evaluate_linear_refuses_mismatched_heldout_ceiling_and_reference():
    t, other = pair(0), pair(1)
    theta = np.eye(t.D)
    narrow = LinearTask(t.X_P[:, :4], t.Y_P, t.X_H[:, :4], t.Y_H)
    with pytest.raises(ParameterError) as e:
        evaluate_linear(theta, t, narrow)
    assert e.value.parameter == "heldout"
    with pytest.raises(ParameterError) as e:
        evaluate_linear(theta, t, ceiling=rir_ceiling(other.X_P, other.X_H))
    assert e.value.parameter == "ceiling"
    with pytest.raises(ParameterError) as e:
        evaluate_linear(theta, t, reference=EvaluationReference(other))
    assert e.value.parameter == "reference"
    # the same rows: accepted
    ev = evaluate_linear(theta, t, other, ceiling=rir_ceiling(t.X_P, t.X_H))
    assert ev.train.rir == pytest.approx(1.0) and ev.fraction_of_ceiling == pytest.approx(
        1 / rir_ceiling(t.X_P, t.X_H).range_restricted
    )
    # the held-out rows are evaluated as the training rows are (their own θ = I reference)
    assert ev.heldout == evaluate_linear(theta, other).train


@pytest.mark.parametrize("c", [1e-3, 1.0, 1e3])
def test_bce_definition_31c_check_does_not_depend_on_the_scale_of_theta(c):
    """Separable D_P (N < D): the probe's ridge is relative to the features' scale, so the scaled
    problems differ by the rounding of Z/s alone and dp_loss_after(cθ) agrees to rtol 1e-9
    (measured
    ~1e-15; a fixed ridge gave 0.037 / 1.9e-7 / 6.5e-13 here at c = 1e-3 / 1 / 1e3)."""
    rng = np.random.default_rng(0)
    X_P, X_H = rng.standard_normal((20, 30)), rng.standard_normal((20, 30))
    t = LinearTask(X_P, (X_P[:, 0] > 0).astype(float), X_H, rng.standard_normal(20), loss="bce")
    base = evaluate_linear(np.eye(30), t).train.dp_loss_after
    assert evaluate_linear(c * np.eye(30), t).train.dp_loss_after == pytest.approx(base, rel=1e-9)


@pytest.mark.parametrize(
    "change,name",
    [
        (dict(Y_P=np.zeros((10, 2)), loss="bce"), "Y_P"),  # BCE takes one label column
        (dict(Y_P=np.full(10, 0.5), loss="bce"), "Y_P"),
        (dict(X_H=np.ones((10, 4))), "X_H"),
        (dict(loss="hinge"), "loss"),
    ],
)
def test_linear_task_names_the_bad_argument(change, name):
    X = np.random.default_rng(0).standard_normal((10, 3))
    args = {"X_P": X, "Y_P": np.ones(10), "X_H": X, "Y_H": np.ones(10), **change}
    with pytest.raises(ParameterError) as e:
        LinearTask(**args)
    assert e.value.parameter == name


def test_certified_mode_takes_every_option_of_algorithm_1_and_its_safety():
    """Any option of "ours" reaches certified mode as given, and ``safety`` is certified mode's
    alone: plain Algorithm 1 refuses it by name."""
    t = pair(2)
    given = {**resolve_options("ours", "house_price").to_dict(), "epochs": 3, "lr": 0.01}
    res = immunize_certified(t, rng=np.random.default_rng(0), safety=0.5, **given)
    assert res.options == resolve_options("ours", certified=True, safety=0.5, **given)
    assert res.options.safety == 0.5 and res.options.lr == 0.01 and res.options.epochs == 3
    assert res.diagnostics["certified"]["checked"] > 0
    with pytest.raises(ParameterError) as e:
        immunize(t, "ours", rng=np.random.default_rng(0), preset="house_price", safety=0.5)
    assert e.value.parameter == "safety"
    with pytest.raises(ParameterError) as e:
        resolve_options("imma", certified=True)
    assert e.value.parameter == "certified"


def test_a_task_keeps_its_own_read_only_copy_of_the_callers_arrays():
    rng = np.random.default_rng(0)
    X_P, X_H = rng.standard_normal((30, 5)), rng.standard_normal((25, 5))
    task = LinearTask(X_P, rng.standard_normal(30), X_H, rng.standard_normal(25))
    before = immunize(task, "identity", rng=rng)
    K_P = task.K_P.copy()
    X_P[:, 0] *= 1e3  # the caller edits their arrays after building the task
    X_H[:, 1] *= 1e-3
    after = immunize(task, "identity", rng=rng)
    assert before.harmful_ratio == after.harmful_ratio == 1.0
    assert before.pretrain_ratio == after.pretrain_ratio == 1.0
    np.testing.assert_array_equal(task.K_P, K_P)
    for a in (task.X_P, task.Y_P, task.X_H, task.Y_H, task.K_P, task.K_H):
        with pytest.raises(ValueError):
            a[0, 0] = 0.0  # read-only: nothing can edit the task in place


def _deep_error():
    from pycore.deep import NonFiniteLossError

    return NonFiniteLossError("lr", "loss is NaN", 7)


def _op_error():
    from pycore.ops import CondRegError

    return CondRegError("Z", "Z is sparse")


@pytest.mark.parametrize(
    "make",
    [
        lambda: ParameterError("lambda_h", "too large"),
        lambda: DivergenceError("lr", "θ is NaN"),
        lambda: SpectrumError("X_P is zero"),
        _deep_error,
        _op_error,
    ],
    ids=[
        "ParameterError",
        "DivergenceError",
        "SpectrumError",
        "NonFiniteLossError",
        "CondRegError",
    ],
)
def test_exceptions_cross_process_boundaries_as_themselves(make):
    """Every error that carries ``.parameter`` takes it first and keeps it through a pickle."""
    exc = make()
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and back.args == exc.args and back.__dict__ == exc.__dict__
    if hasattr(exc, "parameter"):
        assert back.parameter == exc.parameter != str(exc)
