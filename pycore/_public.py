"""How a public namespace presents the objects it re-exports from the private modules."""

from __future__ import annotations

import inspect


def publish(namespace: str, scope: dict, names: list[str]) -> None:
    """Give the names a namespace re-exports that namespace as their ``__module__``.

    Give every class and function of ``names`` (in ``scope``) the namespace it is documented
    under as its ``__module__``, as NumPy does for its own: reprs, tracebacks and pickles then
    name the path users import from (``pycore.ParameterError``), not the private module that
    defines it. Constants are left as they are.
    """
    for name in names:
        obj = scope[name]
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__.startswith(
            "pycore."
        ):
            obj.__module__ = namespace
