"""Fixtures shared by the test files."""

from __future__ import annotations

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
