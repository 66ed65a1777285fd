"""What the test environment asks for: Kafka versions and the way to run them.

Read once from the environment (see tests/conftest.py for every variable); the fixtures in
tests/support/fixtures/ and the tests that start clusters or workers of their own use these.
"""

from __future__ import annotations

import os
from typing import cast

from dualwrite.dev.kafka_cluster import Backend

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
