"""A method added in one place (its record, registered) runs through immunize and the report."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from pycore import (
    METHODS,
    LinearOptions,
    LinearTask,
    Method,
    MethodRun,
    ParameterError,
    evaluate_linear,
    immunize,
    immunize_batch,
    method_of,
    options_of,
    register_method,
    unregister_method,
)
from pycore._immunization import check_method_work
from pycore._spectral import gram_spectrum
from pycore._worst_case_analysis import Variant
from pycore.report import METHOD_LABELS, read_json, write_json


@dataclass(frozen=True)
class ScaleOptions(LinearOptions):
    """θ = diag(scale, 1, ..., 1): the first input stretched."""

    RULES = {**LinearOptions.RULES, "scale": dict(low=0.0, low_open=True)}
    scale: float = 2.0

    @property
    def draws_random(self) -> bool:
        return False


def _scale_first(task, options, rngs):
    theta = np.eye(task.D)
    theta[0, 0] = options.scale
    return [MethodRun(theta.copy(), None, {}, {"calls": 1}, "stretched") for _ in rngs]


# the one place the toy method is declared
TOY = Method("toy_scale", "Toy (first input stretched)", ScaleOptions, _scale_first, work=(2, 1))


@pytest.fixture
def toy():
    register_method(TOY)
    yield TOY.name
    unregister_method(TOY.name)


def _task(seed=0, D=4):
    rng = np.random.default_rng(seed)
    X_P = rng.standard_normal((30, D))
    X_H = rng.standard_normal((25, D)) * [3.0, 1.0, 1.0, 0.5]
    return LinearTask(X_P, X_P @ rng.standard_normal(D), X_H, X_H @ rng.standard_normal(D))


def _kappa(X):
    return gram_spectrum(X, vectors=False).kappa


def test_a_registered_method_runs_through_immunize_with_its_options_checked(toy):
    task = _task()
    res = immunize(task, toy, rng=np.random.default_rng(0), scale=5.0)
    theta = np.diag([5.0, 1.0, 1.0, 1.0])
    assert res.method == toy and res.options == ScaleOptions(scale=5.0)
    np.testing.assert_array_equal(res.theta, theta)
    # (i) and (ii) are κ's of the toy's θ against θ = I, computed here on their own
    i = _kappa(task.X_H @ theta) / _kappa(task.X_H)
    ii = _kappa(task.X_P @ theta) / _kappa(task.X_P)
    assert res.harmful_ratio == pytest.approx(i, rel=1e-12)
    assert res.pretrain_ratio == pytest.approx(ii, rel=1e-12)
    assert res.immunized == (i > 1 and ii < 1) and res.reason.startswith("stretched;")
    assert options_of(toy) is ScaleOptions and toy not in METHODS
    with pytest.raises(ParameterError) as bad:
        immunize(task, toy, rng=np.random.default_rng(0), scale=-1.0)
    assert bad.value.parameter == "scale"
    with pytest.raises(ParameterError) as unknown:
        immunize(task, toy, rng=np.random.default_rng(0), epochs=3)
    assert unknown.value.parameter == "epochs"
    runs = immunize_batch(task, toy, rngs=[np.random.default_rng(s) for s in (0, 1)])
    one = immunize(task, toy, rng=np.random.default_rng(2))  # the default scale, 2
    assert [r.rir for r in runs] == [one.rir, one.rir]
    np.testing.assert_array_equal(runs[1].theta, np.diag([2.0, 1.0, 1.0, 1.0]))


def test_a_registered_method_reaches_the_report(toy, tmp_path):
    task = _task(1)
    res = immunize(task, toy, rng=np.random.default_rng(0))
    assert METHOD_LABELS[toy] == "Toy (first input stretched)"
    assert Variant(toy, "haar").label == "Toy (first input stretched) + haar"
    ev = evaluate_linear(res.theta, task)
    write_json(tmp_path / "results.json", {"method": toy, "evaluation": ev})
    back = read_json(tmp_path / "results.json")
    assert back["evaluation"]["train"]["rir"] == pytest.approx(res.rir, rel=1e-12)


def test_a_method_s_work_is_checked_before_it_runs(toy):
    task = _task()
    small = check_method_work(task, toy)
    calls = []

    def greedy(task, options, rngs):
        calls.append(1)
        return _scale_first(task, options, rngs)

    register_method(Method("toy_greedy", "greedy", ScaleOptions, greedy, work=(10**9, 10**9)))
    try:
        with pytest.raises(ValueError):
            immunize(task, "toy_greedy", rng=np.random.default_rng(0))
        assert calls == []  # refused before the runner was called
    finally:
        unregister_method("toy_greedy")
    assert small == check_method_work(task, "identity")  # the same work, (2, 1)


def test_the_registry_refuses_what_it_cannot_run(toy):
    for bad in (
        TOY,  # the name is taken
        Method("toy_b", "b", dict, _scale_first, work=(2, 1)),
        Method("toy_c", "c", ScaleOptions, "not callable", work=(2, 1)),
        Method("toy_d", "d", ScaleOptions, _scale_first, work=(2,)),
    ):
        with pytest.raises(ParameterError) as err:
            register_method(bad)
        assert err.value.parameter == "method"
    with pytest.raises(ParameterError):
        unregister_method("imma")  # the library's own
    assert method_of("imma").label == METHOD_LABELS["imma"] == "IMMA"


def test_an_unregistered_method_is_unknown_again():
    register_method(TOY)
    unregister_method(TOY.name)
    with pytest.raises(ParameterError) as err:
        immunize(_task(), TOY.name, rng=np.random.default_rng(0))
    assert err.value.parameter == "method" and TOY.name not in METHOD_LABELS
