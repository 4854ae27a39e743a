"""Single access point to the fused condition-number op (:mod:`pycore.ops`).

Everything in :mod:`pycore.deep` that needs R_ill / R_well or the preconditioned immunization
layer goes through :func:`ops`, so a missing or broken extension produces one clear message.
"""
from __future__ import annotations

import importlib

__all__ = ["ops"]

_OPS = None


def ops():
    """Return the :mod:`pycore.ops` module (fused op, or its own pure-PyTorch fallback)."""
    global _OPS
    if _OPS is None:
        try:
            _OPS = importlib.import_module("pycore.ops")
        except ImportError as exc:  # pragma: no cover - depends on the checkout
            raise ImportError(
                f"pycore.deep needs pycore.ops (R_ill/R_well op and ImmunizationHead): {exc}"
            ) from exc
    return _OPS
