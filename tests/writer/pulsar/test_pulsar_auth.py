"""The Pulsar participant on a broker with token authentication and authorization on: the pool
and a writer run with a role's token, a crash after the decision is recovered with that role's
token (another role may not end the transaction: the coordinator's owner check), a bad token is
a typed refusal, and no token appears in any output, at any verbosity."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa

from dualwrite.pulsar import PulsarDualWriterPool
from tests.support.cli import dw
from tests.support.pulsar.broker import token_auth_pulsar
from tests.support.pulsar.checks import assert_invariant, worker
from tests.support.workers.pulsar_worker import ORDERS

if TYPE_CHECKING:
    from dualwrite.dev.pulsar_cluster import LocalPulsar

pytestmark = pytest.mark.timeout(300)

SERVICE, OTHER, ADMIN = "orders-service", "reporting", "admin"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalPulsar,
                                                                         dict[str, str]]]:
    with token_auth_pulsar(tmp_path_factory.mktemp("pulsar-auth"), (SERVICE, OTHER),
                           ADMIN) as (broker, tokens):
        yield broker, tokens


def test_pool_writer_crash_and_recover_with_a_roles_token(
        secured: tuple[LocalPulsar, dict[str, str]], db: str, tmp_path: Path) -> None:
    broker, tokens = secured
    topic = f"persistent://public/default/secured-{uuid.uuid4().hex[:8]}"
    status, body = broker.admin_request(
        "PUT", "/admin/v2/" + topic.replace("persistent://", "persistent/") + "/partitions", 3)
    assert status in (200, 204), body
    files = {}
    for role, token in {**tokens, "forged": tokens[SERVICE][:-4] + "AAAA"}.items():
        files[role] = tmp_path / f"{role}.token"
        files[role].write_text(token + "\n", encoding="utf-8")

    with PulsarDualWriterPool(db, broker.service_url, id_prefix="secured", size=2,
                              token=tokens[SERVICE]) as pool:
        for n in range(4):
            with pool.transaction() as tx:
                tx.connection.execute(sa.insert(ORDERS).values(id=n, writer="pool"))
                tx.send(topic, str(n), key=str(n))
        assert tokens[SERVICE] not in repr(pool)

    run = worker(broker, db, topic, "secured-w", 10, 3, "--kill-at", "11", "--phase",
                 "database_committed", "--token-file", str(files[SERVICE]))
    assert run.returncode == -9, run.stdout + run.stderr

    def cli(*args: str) -> tuple[int, str]:
        result = dw(*args, "--db", db, "--pulsar-url", broker.service_url)
        out = result.stdout + result.stderr
        for token in tokens.values():
            assert token not in out  # at any verbosity
        return result.returncode, out

    # A forged token: refused by the broker, a typed error, the row untouched.
    code, out = cli("-v", "status", "--pulsar-token-file", str(files["forged"]))
    assert code != 0 and "Traceback" not in out, out
    assert re.search(r"authenticat", out, re.IGNORECASE), out
    # Another role may not end the service's transaction: recover says so (not "retry": the
    # coordinator's owner check answers TransactionNotFound) and leaves it.
    code, out = cli("-v", "recover", "--pulsar-token-file", str(files[OTHER]))
    assert code != 0 and "Traceback" not in out and "secured-w" in out, out
    assert "neither the owner" in out and "role that opened the transaction" in out, out
    code, out = cli("status", "--pulsar-token-file", str(files[SERVICE]))
    assert code == 5 and re.search(r"^secured-w +in-doubt ", out, re.MULTILINE), out
    # The owner's role (or a super user's) commits it.
    code, out = cli("-vv", "recover", "--pulsar-token-file", str(files[SERVICE]))
    assert code == 0 and "secured-w: committed" in out, out
    assert_invariant(broker, db, topic, expected={0, 1, 2, 3, 10, 11},
                     token=tokens[SERVICE])
