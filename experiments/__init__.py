"""The experiment scripts (paper Sec. 5 and the worst-case and deep studies); what their command
lines share is :mod:`experiments.common`.  Not installed: run one from the checkout, as ``python
experiments/house_price.py`` or, from the checkout's root, ``python -m experiments.house_price``,
after ``bash scripts/install.sh``."""
