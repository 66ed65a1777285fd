"""The suite's command-line options and the plugins holding its shared fixtures (real Kafka
clusters and databases started locally, see docs/dev-cluster.md; tests/support/fixtures/).

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

import pytest

# The shared fixtures, one plugin per kind (test modules override them by name).
pytest_plugins = [
    "tests.support.fixtures.kafka",
    "tests.support.fixtures.proxied_kafka",
    "tests.support.fixtures.databases",
    "tests.support.fixtures.writers",
    "tests.support.fixtures.spark",
]


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
    parser.addoption(
        "--spark-full", action="store_true", default=False,
        help="kill the Spark driver at every crash point on every database "
             "(tests/spark/test_sink.py); CI runs a subset",
    )
    parser.addoption(
        "--faults-full", action="store_true", default=False,
        help="also run the fault suite's short form and the Spark sink's broker faults on their "
             "own; CI runs the soak (tests/soak), which injects every kind of both together",
    )
    parser.addoption(
        "--pulsar-full", action="store_true", default=False,
        help="also pin Pulsar's transaction behaviour with its own Java client "
             "(tests/participant/test_pulsar_facts.py); CI runs our client's tier only",
    )


#: Tiers CI leaves out: marker -> (the option that runs it, why the test is skipped without it).
FULL_TIERS = {
    "mariadb_full": ("--mariadb-full", "MariaDB beyond the quick subset"),
    "compat_full": ("--compat-full", "compatibility tier, full form"),
    "pulsar_full": ("--pulsar-full", "Pulsar facts via the Java client"),
    "spark_full": ("--spark-full", "Spark crash points beyond CI's subset"),
    "faults_full": ("--faults-full", "a fault suite the soak's CI form covers"),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for marker, (option, why) in FULL_TIERS.items():
        if config.getoption(option):
            continue
        skip_tier = pytest.mark.skip(reason=f"{why}: run with {option}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip_tier)
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="slow soak test: run with --soak")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
