"""One Pulsar standalone broker (``LocalPulsar``, transactions on) for a test package's
``pulsar_broker`` fixture; it needs java, javac and mvn, and its tests are skipped otherwise."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from dualwrite.dev.pulsar_cluster import LocalPulsar

HAS_JAVA = all(shutil.which(t) for t in ("java", "javac", "mvn"))


def local_pulsar() -> Iterator[LocalPulsar]:
    """Start a broker, yield it, stop it (the body of a package-scoped fixture)."""
    if not HAS_JAVA:
        pytest.skip("needs java, javac and mvn (Pulsar from Maven jars)")
    from dualwrite.dev.pulsar_cluster import DEFAULT_PULSAR_VERSION, LocalPulsar

    with LocalPulsar(DEFAULT_PULSAR_VERSION) as broker:
        yield broker
