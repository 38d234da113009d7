"""Which part of a long test matrix runs: the CI slice by default, every case with
``TAPAS_FULL_MATRIX=1`` (``bash scripts/test_full.sh``, which runs the whole suite so).

In:  the slice and the whole matrix a test would run.
Out: one of them.
"""

from __future__ import annotations

import os
from typing import TypeVar

T = TypeVar("T")


def full() -> bool:
    """Whether this run asked for every case of the long matrices."""
    return os.environ.get("TAPAS_FULL_MATRIX", "") == "1"


def pick(ci_slice: T, everything: T) -> T:
    """``everything`` under ``TAPAS_FULL_MATRIX=1``, else the slice CI runs."""
    return everything if full() else ci_slice


def only_in_full_matrix(test: T) -> T:
    """Skip ``test`` unless ``TAPAS_FULL_MATRIX=1``: a case of a long matrix whose code paths
    a faster case of the suite also runs (the reason names it)."""
    import pytest
    return pytest.mark.skipif(not full(), reason="a case of a long matrix: bash "
                              "scripts/test_full.sh runs it")(test)
