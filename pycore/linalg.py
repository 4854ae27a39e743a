"""The float64 building blocks of the linear core (docs/design.md §4, §6).

Spectra of Gram matrices from one factorisation (:class:`SymmetricEigen`, :class:`RowFactor`,
:class:`ProductGramSpectrum`), a stack of runs' spectra from the small side (:class:`GramStack`),
the regularizer terms of a linear-probing Hessian (:func:`hessian_regularizer`), the
preconditioned θ-directions of Algorithm 1 (:func:`precondition`, :class:`Preconditioner`,
:class:`FactorPreconditioner`) and the k-step probe of many θ (:class:`KStepProbe`). The loops of
:func:`pycore.immunize` are made of these; they are public so that each can be checked against
the dense formulas of docs/theory.md on its own.
"""

from pycore._batch import GramStack, GramTerm
from pycore._kstep import KStepProbe, probe_matrix
from pycore._precondition import (
    FactorPreconditioner,
    G_parts,
    Preconditioner,
    precondition,
    ridge_factor,
    theta_G,
)
from pycore._public import publish
from pycore._regularizers import (
    HessianRegularizer,
    grad_theta_and_regularizer,
    hessian_regularizer,
)
from pycore._spectral import ProductGramSpectrum, RowFactor, SymmetricEigen

__all__ = [
    "SymmetricEigen",
    "RowFactor",
    "ProductGramSpectrum",
    "GramStack",
    "GramTerm",
    "HessianRegularizer",
    "hessian_regularizer",
    "grad_theta_and_regularizer",
    "G_parts",
    "theta_G",
    "precondition",
    "ridge_factor",
    "Preconditioner",
    "FactorPreconditioner",
    "KStepProbe",
    "probe_matrix",
]
publish(__name__, globals(), __all__)
del publish
