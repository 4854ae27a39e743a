"""The public API's docstrings (numpydoc style): every public function documents its parameters
and what it returns and shows how it is called, every public class says what it is, and the
Examples sections run as written."""

from __future__ import annotations

import doctest
import importlib
import inspect
import re

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


@pytest.fixture
def one_torch_thread():
    """One torch thread while an example runs, as the deep tests run (their networks are tiny:
    a second thread only waits on a busy machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
def test_docstring_examples_run(name, test, one_torch_thread):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    with np.printoptions(legacy="1.25"):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} example(s) of {name} failed (output above)"


def _functions():
    """``(qualified name, function)`` of every function in a public namespace's ``__all__``."""
    out = []
    for space in NAMESPACES:
        module = importlib.import_module(space)
        out += [
            (f"{space}.{name}", getattr(module, name))
            for name in module.__all__
            if inspect.isroutine(getattr(module, name))
        ]
    return out


FUNCTIONS = _functions()


def _section(doc: str, title: str) -> str | None:
    """The body of the numpydoc section ``title`` of ``doc``, or None without one."""
    m = re.search(
        rf"^{title}\n-{{{len(title)}}}\n(.*?)(?=\n\n\S[^\n]*\n-{{3,}}\n|\Z)", doc, re.S | re.M
    )
    return None if m is None else m.group(1)


@pytest.mark.parametrize("name,func", FUNCTIONS, ids=[name for name, _ in FUNCTIONS])
def test_public_functions_document_their_parameters_and_what_they_return(name, func):
    doc = inspect.getdoc(func) or ""
    assert _section(doc, "Returns"), f"{name} has no Returns section"
    params = list(inspect.signature(func).parameters)
    if params:
        section = _section(doc, "Parameters")
        assert section, f"{name} has no Parameters section"
        documented = {
            n.strip().lstrip("*")
            for line in section.split("\n")
            if line and not line.startswith(" ")
            for n in line.split(" : ")[0].split(",")
        }
        assert set(params) <= documented, (name, sorted(set(params) - documented))


@pytest.mark.parametrize("space", NAMESPACES)
def test_every_public_function_is_documented_with_an_example_that_runs(space):
    module = importlib.import_module(space)
    examples = {name for name, _ in EXAMPLES}
    for name in module.__all__:
        func = getattr(module, name)
        if not inspect.isroutine(func):
            continue
        doc = inspect.getdoc(func) or ""
        assert _section(doc, "Returns") and _section(doc, "Examples"), f"{space}.{name}"
        if inspect.signature(func).parameters:
            assert _section(doc, "Parameters"), f"{space}.{name}"
        assert any(e == f"{space}.{name}" or e.startswith(f"{space}.{name}.") for e in examples)


@pytest.mark.parametrize("space", NAMESPACES)
def test_every_public_class_has_its_own_docstring(space):
    """A class's own docstring, not one it inherits or a dataclass's generated signature."""
    module = importlib.import_module(space)
    for name in module.__all__:
        cls = getattr(module, name)
        if inspect.isclass(cls):
            doc = cls.__dict__.get("__doc__") or ""
            assert doc.strip() and not doc.startswith(f"{cls.__name__}("), f"{space}.{name}"


def test_the_docstring_check_finds_a_missing_section():
    def documented(a, b):
        """One line.

        Parameters
        ----------
        a, b : int
            Two numbers.

        Returns
        -------
        int
        """

    def undocumented(a):
        """One line."""

    assert _section(inspect.getdoc(documented), "Parameters").startswith("a, b : int")
    assert _section(inspect.getdoc(documented), "Returns") == "int"
    assert _section(inspect.getdoc(undocumented), "Returns") is None
