"""Fixtures shared by the test files."""

from __future__ import annotations

import copy
import sys

import pytest


@pytest.fixture
def tripwire(monkeypatch):
    """Any computation of a linear experiment fails the test loudly (exit 1, 'COMPUTED'), so a
    usage error that slips past the checks before the work cannot pass as exit 2."""
    from experiments import attacks, frontier, house_price, mnist

    def boom(*a, **k):
        raise AssertionError("COMPUTED")

    for mod in (house_price, mnist, attacks, frontier):
        monkeypatch.setattr(mod, "run", boom)


@pytest.fixture
def work_spy(monkeypatch):
    """The modules the deep API deep-copied, in order: the first piece of work of
    ``immunize_model`` (the copy it immunizes) and of ``audit_model`` (the copies it attacks) is
    a copy of a model, so a check that comes before any work leaves the list empty."""
    calls, real = [], copy.deepcopy

    def spy(x, memo=None):
        nn = sys.modules.get("torch.nn")
        if nn is not None and isinstance(x, nn.Module):
            calls.append(x)
        return real(x, memo)

    monkeypatch.setattr(copy, "deepcopy", spy)
    return calls
