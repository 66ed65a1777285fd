"""Local development servers: a real Apache Kafka cluster, a PostgreSQL server on loopback (with a
streaming standby, and PgBouncer in front of it, for the database-operations tests) and a MariaDB
server.

Used by the test suite (``tests/conftest.py``) and by ``dualwrite dev up|status|down``.
"""

from __future__ import annotations

from dualwrite.dev._util import DevClusterError, docker_available, dualwrite_home
from dualwrite.dev.kafka_cluster import (
    DEFAULT_KAFKA_VERSION,
    BrokerNode,
    ExternalKafkaCluster,
    KafkaTarget,
    LocalKafkaCluster,
    create_topic,
    transactional_defaults,
)
from dualwrite.dev.mariadb_cluster import LocalMariaDB
from dualwrite.dev.pgbouncer import LocalPgBouncer
from dualwrite.dev.postgres_cluster import LocalPostgres
from dualwrite.dev.verify import read_committed

__all__ = [
    "DEFAULT_KAFKA_VERSION",
    "BrokerNode",
    "DevClusterError",
    "ExternalKafkaCluster",
    "KafkaTarget",
    "LocalKafkaCluster",
    "LocalMariaDB",
    "LocalPgBouncer",
    "LocalPostgres",
    "create_topic",
    "docker_available",
    "dualwrite_home",
    "read_committed",
    "transactional_defaults",
]
