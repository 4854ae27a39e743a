"""The experiment scripts of pycore (paper Sec. 5) and their shared command-line layer.

Each module runs as a script or as a module, from an installed package (``pip install -e .``)
or from the repository root with ``PYTHONPATH=.``::

    python experiments/house_price.py --seeds 3
    python -m experiments.house_price --seeds 3

:mod:`experiments.cli` holds what every script shares: the flag syntax (seeds, method lists,
flags generated from the configuration dataclasses), checks of every flag before any compute,
exit codes (2 usage, 1 data/runtime), one-line errors, atomic output sets and worker processes
that stop with their parent; it composes :mod:`experiments.flags`, :mod:`experiments.config_flags`,
:mod:`experiments.errors`, :mod:`experiments.outputs` and :mod:`experiments.workers`.
"""
import sys

if sys.argv[:1] == ["-m"]:   # python -m experiments.x: this runs before the script's first import
    from experiments import _startup  # noqa: F401
