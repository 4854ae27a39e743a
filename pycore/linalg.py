"""The float64 building blocks of the linear core (docs/design.md §4, §6).

A task's rows factored once (:class:`RowFactor`), a stack of runs' spectra from the small side
(:class:`GramStack`), the regularizer terms of a linear-probing Hessian
(:func:`hessian_regularizer`) and the k-step probe of many θ (:class:`KStepProbe`): what the loops
of :func:`pycore.immunize` are made of, each checkable on its own against the dense formulas of
docs/theory.md. The preconditioners and the eigensolver are in the private modules they are
defined in (``pycore._precondition``, ``pycore._spectral``).
"""

from pycore._batch import GramStack
from pycore._kstep import KStepProbe
from pycore._public import publish
from pycore._regularizers import hessian_regularizer
from pycore._spectral import RowFactor

__all__ = [
    "RowFactor",
    "GramStack",
    "hessian_regularizer",
    "KStepProbe",
]
publish(__name__, globals(), __all__)
del publish
