"""The batch tests' fixtures: a control plane with the coordinator's timeout, a fresh sink id."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from dualwrite.participant import ControlPlane
from tests.support.kafka import unique


@pytest.fixture
def cp(kconf: dict[str, Any]) -> Iterator[ControlPlane]:
    with ControlPlane(kconf, timeout_s=20) as plane:
        yield plane


@pytest.fixture
def sink() -> str:
    return unique("sink")
