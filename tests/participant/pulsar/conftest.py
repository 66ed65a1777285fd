"""One Pulsar standalone broker (``LocalPulsar``, transactions on) for every broker test of this
package; it needs java, javac and mvn, and the tests using it are skipped otherwise."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from dualwrite.dev.pulsar_cluster import LocalPulsar

HAS_JAVA = all(shutil.which(t) for t in ("java", "javac", "mvn"))


@pytest.fixture(scope="package")  # stopped once this package's tests are done
def pulsar_broker() -> Iterator[LocalPulsar]:
    if not HAS_JAVA:
        pytest.skip("needs java, javac and mvn (Pulsar from Maven jars)")
    from dualwrite.dev.pulsar_cluster import DEFAULT_PULSAR_VERSION, LocalPulsar

    with LocalPulsar(DEFAULT_PULSAR_VERSION) as broker:
        yield broker
