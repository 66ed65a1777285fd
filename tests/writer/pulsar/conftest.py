"""One Pulsar standalone broker for the PulsarDualWriter tests of this package."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.support.pulsar.broker import local_pulsar
from tests.support.workers.pulsar_worker import create_orders_table

if TYPE_CHECKING:
    from dualwrite.dev.pulsar_cluster import LocalPulsar


@pytest.fixture(scope="package")  # stopped once this package's tests are done
def pulsar_broker() -> Iterator[LocalPulsar]:
    yield from local_pulsar()


@pytest.fixture(params=["postgresql"])
def db(request: pytest.FixtureRequest) -> str:
    """A fresh database with dualwrite's tables and ``pulsar_orders`` (PostgreSQL unless a test
    asks for more with ``parametrize("db", [...], indirect=True)``)."""
    fixture = {"postgresql": "pg_db_url", "mariadb": "mariadb_db_url",
               "sqlite": "sqlite_db_url"}[request.param]
    url = str(request.getfixturevalue(fixture))
    create_orders_table(url)
    return url


@pytest.fixture
def topic(pulsar_broker: LocalPulsar) -> str:
    """A new topic of 3 partitions."""
    name = f"persistent://public/default/orders-{uuid.uuid4().hex[:8]}"
    status, body = pulsar_broker.admin_request(
        "PUT", "/admin/v2/" + name.replace("persistent://", "persistent/") + "/partitions", 3)
    assert status in (200, 204), body
    return name
