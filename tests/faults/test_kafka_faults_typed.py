"""Only typed errors reach the caller when the broker path fails (through the loopback proxy).

Broker unreachable at start, connection cut mid-produce and mid-flush, coordinator blackholed:
DualWriter, TwoPhaseProducer, ``dualwrite.recover`` / ``status`` and the CLI either succeed or
raise a :class:`dualwrite.DualWriteError` of the right family; the CLI prints no traceback.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import dualwrite
from dualwrite import (
    DualWriteError,
    DualWriter,
    FatalError,
    HeuristicOutcomeError,
    RecoverableError,
    RetriableError,
)
from dualwrite.cli import main as cli_main
from dualwrite.dev import LocalKafkaCluster
from tests.support.kafka import unique
from tests.support.tcp_proxy import TcpProxy, kafka_api


@pytest.fixture
def topic(cluster: LocalKafkaCluster) -> str:
    """A topic on the proxied cluster (``proxied``, ``proxy`` and ``cluster`` are fixtures of
    tests/support/fixtures/proxied_kafka.py: a cluster of this module's own)."""
    return cluster.create_topic(unique("lost"), 1, 1)

pytestmark = pytest.mark.timeout(300)

FAMILIES = (RetriableError, RecoverableError, FatalError, HeuristicOutcomeError)


def _typed(call: Callable[[], Any], seen: list[str]) -> None:
    """Run ``call``; anything it raises must be a DualWriteError of one of the families."""
    try:
        call()
    except DualWriteError as exc:
        assert isinstance(exc, FAMILIES), f"{type(exc).__name__} is in no family"
        seen.append(type(exc).__name__)
    else:
        seen.append("ok")


def _config(target: Any) -> dict[str, Any]:
    return {"bootstrap.servers": target.external_bootstrap_servers, "socket.timeout.ms": 3000}


def test_broker_unreachable_at_start(cluster: Any, proxy: TcpProxy, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    dualwrite.upgrade_database(url)
    seen: list[str] = []
    proxy.refuse()
    conf = _config(cluster)

    def writer() -> None:
        with DualWriter(url, conf, transactional_id=unique("unreach"), timeout_s=3) as w, \
                w.transaction() as tx:
            tx.produce("nowhere", b"x")

    def producer() -> None:
        p = dualwrite.TwoPhaseProducer({**conf, "transactional.id": unique("unreach")},
                                       timeout_s=3)
        try:
            p.init_transactions()
        finally:
            p.close()

    _typed(writer, seen)
    _typed(producer, seen)
    _typed(lambda: dualwrite.recover(url, conf, ["some-id"], timeout_s=3), seen)
    _typed(lambda: dualwrite.status(url, conf, timeout_s=3), seen)
    for command in ("recover", "status"):
        result = CliRunner().invoke(cli_main, [command, "--db", url, "-b",
                                               cluster.external_bootstrap_servers,
                                               "--timeout", "3"])
        assert "Traceback" not in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), \
            repr(result.exception)
        seen.append(f"cli {command} exit {result.exit_code}")
    print(f"broker unreachable: {seen}")
    assert "ok" not in seen[:2]


def test_connection_cut_mid_produce_flush_and_endtxn(cluster: Any, proxy: TcpProxy, topic: str,
                                                     tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    dualwrite.upgrade_database(url)
    table = sa.Table("typed_rows", sa.MetaData(), sa.Column("id", sa.String(40),
                                                            primary_key=True))
    table.create(dualwrite.create_engine(url))
    seen: list[str] = []
    tid = unique("cut")
    with DualWriter(url, _config(cluster), transactional_id=tid, timeout_s=8) as writer:

        def write(key: str, fault: Callable[[], object]) -> None:
            with writer.transaction() as tx:
                tx.produce(topic, key.encode(), key=key)
                fault()
                tx.produce(topic, key.encode() + b"-2", key=key)
                tx.connection.execute(sa.insert(table).values(id=key))

        _typed(lambda: write("produce", proxy.cut), seen)
        def hold_for_4s() -> None:
            proxy.blackhole()
            threading.Timer(4.0, proxy.release).start()

        _typed(lambda: write("flush", hold_for_4s), seen)
        time.sleep(4.5)
        proxy.drop_next_response(kafka_api(26))
        _typed(lambda: write("endtxn", proxy.cut), seen)
        proxy.blackhole()
        threading.Timer(5.0, proxy.release).start()
        _typed(lambda: write("blackholed", lambda: None), seen)
        time.sleep(1.0)
        _typed(lambda: write("after", lambda: None), seen)
    _typed(lambda: dualwrite.recover(url, _config(cluster), timeout_s=10), seen)
    _typed(lambda: dualwrite.status(url, _config(cluster), timeout_s=10), seen)
    print(f"cuts: {seen}")
    assert seen[-3] == "ok"  # the writer works again once the path is back
