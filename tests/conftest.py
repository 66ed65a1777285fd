"""Shared fixtures: real Kafka clusters and PostgreSQL started locally (see docs/dev-cluster.md).

Environment variables:

- ``DUALWRITE_TEST_BOOTSTRAP``: use this cluster for ``kafka`` instead of starting one.
- ``DUALWRITE_TEST_BOOTSTRAP_2PC``: the same for ``kafka_2pc`` (brokers must run with
  ``transaction.two.phase.commit.enable=true`` and ``unstable.api.versions.enable=true``).
- ``DUALWRITE_TEST_BOOTSTRAP_39``: the same for ``kafka39``.
- ``DUALWRITE_TEST_POSTGRES_URL``: use this database for ``postgres_url``.
- ``DUALWRITE_TEST_MARIADB_URL``: use this MariaDB server for ``mariadb_url`` (its user needs
  CREATE/DROP DATABASE and KILL of its own sessions).
- ``DUALWRITE_TEST_KAFKA_VERSION`` / ``DUALWRITE_TEST_KAFKA39_VERSION``: versions to start.
- ``DUALWRITE_TEST_COMPAT_VERSIONS``: comma-separated Kafka versions of the compatibility tier
  (tests/participant/test_compat.py); each is started once, alone, while its tests run.
- ``DUALWRITE_TEST_BACKEND``: ``auto`` (default), ``jars`` or ``docker``.

``kafka3`` always starts a local 3-broker cluster (its tests kill and restart brokers).
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import pytest
import sqlalchemy as sa

import dualwrite
from dualwrite.dev import (
    ExternalKafkaCluster,
    KafkaTarget,
    LocalKafkaCluster,
    LocalMariaDB,
    LocalPostgres,
)
from dualwrite.dev.kafka_cluster import Backend
from tests.support.db import fresh_mariadb_database, fresh_schema

KAFKA_VERSION = os.environ.get("DUALWRITE_TEST_KAFKA_VERSION", "4.3.1")
KAFKA39_VERSION = os.environ.get("DUALWRITE_TEST_KAFKA39_VERSION", "3.9.2")
BACKEND = cast(Backend, os.environ.get("DUALWRITE_TEST_BACKEND", "auto"))
# The compatibility tier: every supported release line but the default's (which runs the full
# suite). 4.4.0 resolves from Maven Central since kafka-tools-api 4.4.0 appeared there.
COMPAT_VERSIONS = [v.strip() for v in os.environ.get(
    "DUALWRITE_TEST_COMPAT_VERSIONS", "3.9.2,4.0.2,4.1.2,4.2.2,4.4.0").split(",") if v.strip()]
TWO_PC_CONFIG = {
    "transaction.two.phase.commit.enable": "true",
    "unstable.api.versions.enable": "true",
}


NewTopic = Callable[..., str]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak", action="store_true", default=False, help="also run tests marked `slow`"
    )
    parser.addoption(
        "--faults", type=int, default=0, metavar="N",
        help="also run the long fault suite: N mixed faults on a 3-broker cluster",
    )
    parser.addoption(
        "--mariadb-full", action="store_true", default=False,
        help="run every MariaDB case: the whole crash matrix with DUALWRITE_CRASH_ROUNDS kills "
             "per point, and every writer-protocol test (CI runs a quick subset)",
    )
    parser.addoption(
        "--compat-full", action="store_true", default=False,
        help="run the whole compatibility tier (tests/participant/test_compat.py) on every "
             "version, not only its quick form",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--mariadb-full"):
        skip_mariadb = pytest.mark.skip(reason="MariaDB beyond the quick subset: run with "
                                               "--mariadb-full")
        for item in items:
            if "mariadb_full" in item.keywords:
                item.add_marker(skip_mariadb)
    if not config.getoption("--compat-full"):
        skip_full = pytest.mark.skip(reason="compatibility tier, full form: run with --compat-full")
        for item in items:
            if "compat_full" in item.keywords:
                item.add_marker(skip_full)
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="slow soak test: run with --soak")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _kafka_logger_level() -> Iterator[None]:
    """The CLI, when a test runs it in-process, quiets kafka-python's logger (and at -v opens
    librdkafka's) for the whole process; restore their levels so that later tests see what
    they log and nothing more."""
    loggers = [logging.getLogger(name) for name in ("kafka", "dualwrite.librdkafka")]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(level)


def _cluster(
    env_var: str, version: str, extra: dict[str, str] | None = None
) -> Iterator[KafkaTarget]:
    external = os.environ.get(env_var)
    if external:
        yield ExternalKafkaCluster(external)
        return
    with LocalKafkaCluster(
        brokers=1, kafka_version=version, extra_config=extra, backend=BACKEND
    ) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def kafka() -> Iterator[KafkaTarget]:
    """One Kafka 4.3.1 broker with default transaction settings (no 2PC)."""
    yield from _cluster("DUALWRITE_TEST_BOOTSTRAP", KAFKA_VERSION)


@pytest.fixture(scope="session")
def kafka_2pc() -> Iterator[KafkaTarget]:
    """One Kafka 4.3.1 broker with KIP-939 enabled (2PC and unstable API versions)."""
    yield from _cluster("DUALWRITE_TEST_BOOTSTRAP_2PC", KAFKA_VERSION, TWO_PC_CONFIG)


@pytest.fixture(scope="session")
def kafka39() -> Iterator[KafkaTarget]:
    """One Kafka 3.9.x broker: the last release line before KIP-890 part 2 and KIP-939."""
    yield from _cluster("DUALWRITE_TEST_BOOTSTRAP_39", KAFKA39_VERSION)


@pytest.fixture(scope="session")
def _kafka3_session() -> Iterator[LocalKafkaCluster]:
    with LocalKafkaCluster(brokers=3, kafka_version=KAFKA_VERSION, backend=BACKEND) as cluster:
        yield cluster


@pytest.fixture
def kafka3(_kafka3_session: LocalKafkaCluster) -> LocalKafkaCluster:
    """Three broker+controller nodes (RF 3, min ISR 2), shared by the session.

    Any broker a previous test killed or stopped is restarted first, so tests may kill freely.
    """
    cluster = _kafka3_session
    dead = [n.index for n in cluster.nodes if not cluster.is_running(n.index)]
    for index in dead:
        cluster.restart_broker(index)
    if not dead:
        cluster.wait_until_ready(60.0)
    return cluster


@pytest.fixture(scope="session")
def kafka_secured() -> Iterator[LocalKafkaCluster]:
    """One Kafka 4.3.1 broker with SASL (SCRAM-SHA-512) on SASL_PLAINTEXT and SASL_SSL listeners,
    a CA made for the run, and the StandardAuthorizer (``security="sasl"``, jars backend).

    ``bootstrap_servers`` is the internal PLAINTEXT listener (a super user, for topics and
    ACLs); tests create their own SCRAM users and ACLs. ``DUALWRITE_TEST_SECURED_STATE``: the
    ``cluster.json`` of a running ``dualwrite dev up --security sasl`` to use instead.
    """
    state = os.environ.get("DUALWRITE_TEST_SECURED_STATE")
    if state:
        yield LocalKafkaCluster.from_state(Path(state))
        return
    backend: Backend = "docker" if BACKEND == "docker" else "jars"
    with LocalKafkaCluster(brokers=1, kafka_version=KAFKA_VERSION, backend=backend,
                           security="sasl") as cluster:
        yield cluster


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """SQLAlchemy URL of a session-wide PostgreSQL database (``postgresql+psycopg://``)."""
    external = os.environ.get("DUALWRITE_TEST_POSTGRES_URL")
    if external:
        yield external
        return
    with LocalPostgres() as pg:
        yield pg.url


@pytest.fixture(scope="session")
def mariadb_url() -> Iterator[str]:
    """SQLAlchemy URL of a session-wide MariaDB server's ``dualwrite`` database
    (``mysql+pymysql://``), started once (about 2 s)."""
    external = os.environ.get("DUALWRITE_TEST_MARIADB_URL")
    if external:
        yield external
        return
    with LocalMariaDB() as server:
        yield server.url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """SQLAlchemy URL of a fresh SQLite file for this test."""
    return f"sqlite:///{tmp_path / 'dualwrite.db'}"


@pytest.fixture
def new_topic(request: pytest.FixtureRequest) -> NewTopic:
    """``new_topic(cluster, partitions=3, **kw)``: create a uniquely named topic; its name."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name)[:60].strip("-.")

    def create(cluster: KafkaTarget, partitions: int = 3, **kwargs: object) -> str:
        name = f"{stem}-{uuid.uuid4().hex[:8]}"
        return cluster.create_topic(name, partitions, **kwargs)  # type: ignore[arg-type]

    return create


@pytest.fixture
def bootstrap(kafka: KafkaTarget) -> str:
    """Bootstrap servers of the session's Kafka 4.3.1 (test modules may override it)."""
    return kafka.bootstrap_servers


@pytest.fixture
def topic(kafka: KafkaTarget, new_topic: NewTopic) -> str:
    """A fresh 3-partition topic on the session's Kafka 4.3.1."""
    return new_topic(kafka, partitions=3)


@pytest.fixture(params=["postgresql", "sqlite"])
def backend(request: pytest.FixtureRequest) -> str:
    """The database a test runs on (narrow it with ``parametrize(..., indirect=True)``; widen
    it to MariaDB the same way, with ``"mariadb"``)."""
    return str(request.param)


@pytest.fixture
def empty_db_url(backend: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """An empty database on ``backend``: a fresh SQLite file, a fresh PostgreSQL schema, or a
    fresh MariaDB database."""
    if backend == "sqlite":
        yield request.getfixturevalue("sqlite_url")
        return
    if backend == "mariadb":
        with fresh_mariadb_database(request.getfixturevalue("mariadb_url"), "dw_test") as url:
            yield url
        return
    with fresh_schema(request.getfixturevalue("postgres_url"), "dw_test") as url:
        yield url


@pytest.fixture
def db_url(empty_db_url: str) -> str:
    """``empty_db_url`` with dualwrite's tables (test modules may override it)."""
    dualwrite.upgrade_database(empty_db_url)
    return empty_db_url


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """An engine on ``db_url``, disposed after the test."""
    eng = dualwrite.create_engine(db_url)
    yield eng
    eng.dispose()
