"""The Examples sections of the public API's docstrings run as written (numpydoc style)."""

from __future__ import annotations

import doctest
import importlib
import inspect

import numpy as np
import pytest

# The public namespaces (docs/design.md §1); every name in their ``__all__`` is searched.
NAMESPACES = [
    "pycore",
    "pycore.attacks",
    "pycore.linalg",
    "pycore.report",
    "pycore.data",
    "pycore.ops",
    "pycore.deep",
]


def _examples():
    """``(qualified name, doctest)`` of every docstring with examples, each object once."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    seen, out = set(), []
    for space in NAMESPACES:
        module = importlib.import_module(space)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isroutine(obj)) or id(obj) in seen:
                continue
            seen.add(id(obj))
            for t in finder.find(obj, f"{space}.{name}", module=False, globs={}):
                if t.examples:
                    out.append((t.name, t))
    return out


EXAMPLES = _examples()


def test_the_api_entry_points_have_examples():
    names = {name for name, _ in EXAMPLES}
    for entry in (
        "pycore.immunize",
        "pycore.evaluate_linear",
        "pycore.attack_evaluation",
        "pycore.deep.immunize_model",
        "pycore.deep.audit_model",
    ):
        assert entry in names, entry


@pytest.mark.parametrize("name,test", EXAMPLES, ids=[name for name, _ in EXAMPLES])
def test_docstring_examples_run(name, test):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    with np.printoptions(legacy="1.25"):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} example(s) of {name} failed (output above)"
