"""The writer tests' database: dualwrite's tables and the application table ``app_rows`` that
the recipe's steps (``tests/support/recipe.py``) write."""

from __future__ import annotations

import pytest

from tests.support.tables import add_value_table


@pytest.fixture
def db_url(db_url: str) -> str:
    """dualwrite's tables and the application table ``app_rows``."""
    return add_value_table(db_url, "app_rows")
