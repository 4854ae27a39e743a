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


@pytest.fixture
def work_spy(monkeypatch):
    """The models ``pycore.deep.immunize_model`` copied (its first piece of work), so a test can
    show that a check came before any work."""
    from pycore.deep import api

    calls, real = [], api.as_immunized

    def spy(model, **kw):
        calls.append(model)
        return real(model, **kw)

    monkeypatch.setattr(api, "as_immunized", spy)
    return calls
