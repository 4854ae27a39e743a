"""Fixtures shared by the test files."""
from __future__ import annotations

import pytest


@pytest.fixture
def tripwire(monkeypatch):
    """Any computation fails the test loudly (exit 1 with 'COMPUTED'), so a usage error that slips
    past the checks before the work cannot pass as exit 2."""
    from experiments import attacks, deepnet, house_price, mnist

    def boom(*a, **k):
        raise AssertionError("COMPUTED")
    for mod in (house_price, mnist, attacks):
        monkeypatch.setattr(mod, "run", boom)
    monkeypatch.setattr(deepnet, "run_config", boom)   # the deep pipeline is pycore.deep.evaluate
