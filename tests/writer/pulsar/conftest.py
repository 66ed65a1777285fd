"""One Pulsar standalone broker for the PulsarDualWriter tests of this package."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.support.pulsar.broker import local_pulsar

if TYPE_CHECKING:
    from dualwrite.dev.pulsar_cluster import LocalPulsar


@pytest.fixture(scope="package")  # stopped once this package's tests are done
def pulsar_broker() -> Iterator[LocalPulsar]:
    yield from local_pulsar()
