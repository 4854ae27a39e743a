"""The experiment scripts (paper Sec. 5 and the worst-case and deep studies); what their command
lines share is :mod:`experiments.common`.  Run one as ``python experiments/house_price.py`` or
``python -m experiments.house_price`` after ``bash scripts/install.sh``."""
