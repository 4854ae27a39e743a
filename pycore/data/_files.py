"""Data files shipped inside PyPI packages, found without importing them."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path


def packaged_file(distribution: str, relative: str, hint: str) -> Path:
    """Path of a data file inside an installed distribution, found without importing it."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the data package {distribution!r} is not installed; run scripts/install.sh "
            f"(it installs it with --no-deps) or {hint}"
        ) from None
    path = Path(dist.locate_file(relative))
    if not path.is_file():
        raise FileNotFoundError(f"{distribution!r} is installed but has no {relative}; {hint}")
    return path
