"""The Examples sections of the public API's docstrings run as written (numpydoc style)."""

from __future__ import annotations

import doctest
import importlib

import numpy as np
import pytest

# Every module whose public docstrings carry an Examples section.
MODULES = [
    "pycore.tasks",
    "pycore.options",
    "pycore.immunization",
    "pycore.evaluate",
    "pycore.metrics",
    "pycore.worst_case",
    "pycore.hardening",
    "pycore.ops",
    "pycore.deep.api",
    "pycore.deep.hardening",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = [t for t in finder.find(module) if t.examples]
    assert tests, f"{name} has no Examples to run"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    with np.printoptions(legacy="1.25"):
        for t in tests:
            runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} example(s) of {name} failed (output above)"
