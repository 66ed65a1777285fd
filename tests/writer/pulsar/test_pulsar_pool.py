"""PulsarDualWriterPool against a real Pulsar standalone and a real database: many threads at
once, a request that fails alone, ids kept apart between pools, and a process SIGKILLed under
load, then recovered (by ``dualwrite recover --pulsar-url``, or by the next pool's start).
Every check ends with the invariant of tests/support/pulsar/checks.py."""

from __future__ import annotations

import subprocess
import threading
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa

from dualwrite import create_engine
from dualwrite.errors import ConfigurationError
from dualwrite.pulsar import PulsarDualWriterPool, PulsarTransaction
from dualwrite.writer import StateStore
from tests.support.cli import dw
from tests.support.pulsar.checks import (
    assert_invariant,
    recover_cli,
    wait_until_none_open,
    worker,
)
from tests.support.workers.pulsar_worker import ORDERS

if TYPE_CHECKING:
    from dualwrite.dev.pulsar_cluster import LocalPulsar

pytestmark = pytest.mark.timeout(300)


def insert_and_send(tx: PulsarTransaction, topic: str, n: int) -> int:
    tx.connection.execute(sa.insert(ORDERS).values(id=n, writer="pool"))
    tx.send(topic, str(n), key=str(n))
    return n


@pytest.mark.parametrize("db", ["postgresql", "mariadb"], indirect=True)
def test_requests_of_many_threads_commit_each_once(pulsar_broker: LocalPulsar, db: str,
                                                   topic: str) -> None:
    """Six threads share four writers; every seventh request raises and is rolled back alone
    (its row and message both gone), the others commit."""
    numbers = iter(range(84))
    taken = threading.Lock()
    failures: list[BaseException] = []

    def serve(pool: PulsarDualWriterPool) -> None:
        while True:
            with taken:
                n = next(numbers, None)
            if n is None:
                return
            try:
                with pool.transaction() as tx:
                    insert_and_send(tx, topic, n)
                    if n % 7 == 6:
                        raise ValueError(f"request {n} fails")
            except ValueError:
                continue
            except BaseException as exc:
                failures.append(exc)

    with PulsarDualWriterPool(db, pulsar_broker.service_url, id_prefix="pp-threads",
                              size=4) as pool:
        assert pool.transactional_ids == [f"pp-threads-{n}" for n in range(4)]
        threads = [threading.Thread(target=serve, args=(pool,)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert pool.run(insert_and_send, topic, 100) == 100
        used = {r.transactional_id for r in StateStore(create_engine(db)).read_all()
                if r.prepared_txn_state}
    assert not failures, failures
    assert len(used) > 1, used  # the requests ran on several writers at once
    assert assert_invariant(pulsar_broker, db, topic) == \
        [n for n in range(84) if n % 7 != 6] + [100]


def test_pools_of_one_prefix_take_different_ids_and_bad_input_is_refused(
        pulsar_broker: LocalPulsar, db: str) -> None:
    with PulsarDualWriterPool(db, pulsar_broker.service_url, id_prefix="pp-two", size=2,
                              warm_up=False) as first, \
         PulsarDualWriterPool(db, pulsar_broker.service_url, id_prefix="pp-two", size=2,
                              warm_up=False) as second:
        assert first.transactional_ids == ["pp-two-0", "pp-two-1"]
        assert second.transactional_ids == ["pp-two-2", "pp-two-3"]
    with pytest.raises(ConfigurationError, match="service URL"):
        PulsarDualWriterPool(db, "", id_prefix="pp-bad")
    with pytest.raises(ValueError, match="id_prefix"):
        PulsarDualWriterPool(db, pulsar_broker.service_url, id_prefix="pp bad")


@pytest.mark.parametrize("then", ["recover", "next-pool"])
def test_sigkill_under_load_then_recover(pulsar_broker: LocalPulsar, db: str, topic: str,
                                         then: str) -> None:
    """A pool of four writers serving six threads is SIGKILLed after 30 commits, its other
    transactions anywhere in the protocol. ``dualwrite recover --pulsar-url`` (or the next
    pool's start, which finishes each id's stored state) commits what the database decided;
    Pulsar's timeout aborts what it did not. Nothing committed is lost, nothing doubled."""
    prefix = f"pp-kill-{then}"

    def pool_worker(first: int, count: int, *extra: str) -> subprocess.CompletedProcess[str]:
        return worker(pulsar_broker, db, topic, prefix, first, count, "--pool", "4",
                      "--threads", "6", "--txn-timeout", "15", *extra)

    killed = pool_worker(0, 400, "--kill-after", "30")
    assert killed.returncode == -9 and "KILL" in killed.stdout, killed.stdout + killed.stderr
    told = {int(line.split()[1]) for line in killed.stdout.splitlines()
            if line.startswith("COMMITTED ")}
    assert len(told) >= 30
    if then == "recover":
        result = recover_cli(pulsar_broker, db)
        assert result.returncode == 0, result.stdout + result.stderr
    again = pool_worker(1000, 12)
    assert again.returncode == 0, again.stdout + again.stderr
    status = dw("status", "--db", db, "--pulsar-url", pulsar_broker.service_url)
    assert status.returncode == 0, status.stdout + status.stderr
    wait_until_none_open(pulsar_broker, within_s=60)  # the undecided ones time out
    ids = set(assert_invariant(pulsar_broker, db, topic))
    assert told <= ids, sorted(told - ids)  # every request told "committed" is
    assert set(range(1000, 1012)) <= ids <= set(range(400)) | set(range(1000, 1012))
    print(f"{then}: told committed {len(told)}, rows {len(ids) - 12} of the killed run")
