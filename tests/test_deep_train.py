"""The deep options (pycore/deep/_train.py): their bounds, checked when given."""

from __future__ import annotations

import pytest

from pycore import ParameterError
from pycore.deep import DeepOptions
from pycore.deep._deep_options import options


@pytest.mark.parametrize("lr", [1e30, 1.5, 0.0, -0.1, float("inf")])
def test_an_adaptive_lr_beyond_the_identitys_own_entries_is_refused(lr):
    with pytest.raises(ParameterError) as e:
        options(adaptive_lr=lr)
    assert e.value.parameter == "adaptive_lr"


@pytest.mark.parametrize("lr", [None, 1e-4, 0.27, 1.0])
def test_adaptive_lrs_up_to_one_are_taken(lr):
    assert options(adaptive_lr=lr) == DeepOptions(adaptive_lr=lr)
