"""Property: whatever a caller passes to the public API, only dualwrite errors come out.

Hypothesis generates constructor arguments, Kafka settings, database URLs, record arguments,
prepared-state strings and CLI options; each call either works or raises a
:class:`dualwrite.DualWriteError` (never a TypeError, IndexError, KafkaException, ArgumentError …
from a dependency). Bad input is a :class:`dualwrite.ConfigurationError`, also a ``ValueError``.
Calls that reach the broker share one writer or use few examples: the module stays under a
minute.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dualwrite
from dualwrite import DualWriter, PreparedTxnState
from dualwrite.cli import main as cli
from tests.support.kafka import read_committed

pytestmark = pytest.mark.timeout(180)

QUICK = settings(max_examples=150, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow])
NETWORK = settings(max_examples=25, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow])

anything = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
                     st.binary(max_size=20), st.lists(st.integers(), max_size=3),
                     st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
hosts = st.one_of(st.just("127.0.0.1"), st.just("localhost"), st.just("[::1]"),
                  st.text(max_size=12))
ports = st.one_of(st.integers(-5, 70_000).map(str), st.text(max_size=6))
bootstraps = st.one_of(
    st.builds(lambda h, p: f"{h}:{p}", hosts, ports),
    st.lists(st.builds(lambda h, p: f"{h}:{p}", hosts, ports), max_size=3).map(",".join),
    st.text(max_size=30), st.just(""), st.just(" , "), anything)
urls = st.one_of(
    st.text(max_size=40),
    st.builds(lambda scheme, rest: f"{scheme}://{rest}",
              st.sampled_from(["sqlite", "postgresql", "postgres", "postgresql+psycopg",
                               "postgresql+psycopg2", "mysql", "mysql+pymysql", "oracle",
                               "mssql+pyodbc", "sqlite+pysqlite", "", "http", "a+b+c"]),
              st.text(max_size=30)),
    anything)
timeouts = st.one_of(st.floats(allow_nan=True), st.integers(-10, 100), st.text(max_size=5),
                     st.none())


def _only_dualwrite_errors(call: Any, seen: list[str] | None = None) -> Any:
    try:
        return call()
    except dualwrite.DualWriteError as exc:
        if seen is not None:
            seen.append(type(exc).__name__)
        if isinstance(exc, dualwrite.ConfigurationError):
            assert isinstance(exc, ValueError)
        assert str(exc)
        return None


@pytest.mark.unit
@QUICK
@given(engine=urls, bootstrap=bootstraps, tid=st.one_of(st.text(max_size=10), anything),
       timeout_s=timeouts, verify=st.one_of(st.sampled_from(["auto", "always"]), anything),
       extra=st.dictionaries(st.one_of(st.text(max_size=12), st.integers()), anything,
                             max_size=3))
def test_dual_writer_constructor(engine: Any, bootstrap: Any, tid: Any, timeout_s: Any,
                                 verify: Any, extra: dict[Any, Any]) -> None:
    config = {"bootstrap.servers": bootstrap, **extra}
    writer = _only_dualwrite_errors(lambda: DualWriter(engine, config, transactional_id=tid,
                                                       timeout_s=timeout_s, verify=verify))
    if writer is not None:
        ok_timeout = isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) \
            and timeout_s > 0
        assert ok_timeout and isinstance(tid, str) and tid
        writer.close()


@pytest.mark.unit
@QUICK
@given(url=urls)
def test_create_engine(url: Any) -> None:
    engine = _only_dualwrite_errors(lambda: dualwrite.create_engine(url))
    if engine is not None:
        assert engine.dialect.name in ("sqlite", "postgresql", "mysql", "mariadb")
        engine.dispose()


@pytest.mark.unit
@QUICK
@given(text=st.one_of(
    st.text(max_size=60), anything,
    st.builds(lambda *p: "dw1:" + ":".join(p), *[st.text(max_size=8)] * 4),
    st.builds(lambda a, b, c, d: f"dw1:{a}:{b}:{c}:{d}", st.integers(), st.integers(),
              st.text(max_size=8), st.integers())))
def test_prepared_state_parse(text: Any) -> None:
    state = _only_dualwrite_errors(lambda: PreparedTxnState.parse(text))
    if state is not None:
        assert PreparedTxnState.parse(str(state)) == state


@pytest.fixture
def migrated(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    dualwrite.upgrade_database(url)
    engine = dualwrite.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE items (id INTEGER PRIMARY KEY)"))
    engine.dispose()
    return url


def test_produce_arguments(migrated: str, bootstrap: str, topic: str) -> None:
    """One writer on the shared broker; every transaction writes a row and produces a record
    with generated arguments: it commits both, or raises a dualwrite error and commits neither."""
    writer = DualWriter(migrated, {"bootstrap.servers": bootstrap},
                        transactional_id=f"inputs-{uuid.uuid4().hex[:10]}", timeout_s=10)
    committed: list[bytes] = []
    failed: list[str] = []
    counter = iter(range(1_000_000))
    values = st.one_of(st.binary(max_size=30), st.text(max_size=10), st.none(), anything)

    @NETWORK
    @given(value=values, key=values,
           target=st.one_of(st.just(topic), st.just(topic), st.text(max_size=12), anything),
           partition=st.one_of(st.none(), st.integers(-3, 5), anything),
           headers=st.one_of(st.none(), st.dictionaries(st.text(max_size=5), values,
                                                        max_size=2),
                             st.lists(st.tuples(st.text(max_size=5), values), max_size=2),
                             anything))
    def transaction(value: Any, key: Any, target: Any, partition: Any, headers: Any) -> None:
        row = next(counter)
        marker = f"row-{row}".encode()

        def write() -> bool:
            with writer.transaction() as tx:
                tx.connection.execute(sa.text("INSERT INTO items VALUES (:id)"), {"id": row})
                tx.produce(topic, marker)
                tx.produce(target, value, key, partition=partition, headers=headers)
            return True

        if _only_dualwrite_errors(write, failed):
            committed.append(marker)

    try:
        transaction()
    finally:
        writer.close()
    engine = dualwrite.create_engine(migrated)
    with engine.connect() as conn:
        rows = {f"row-{r[0]}".encode() for r in conn.execute(sa.text("SELECT id FROM items"))}
    engine.dispose()
    seen = {v for v in read_committed(bootstrap, topic) if v.startswith(b"row-")}
    assert rows == seen == set(committed)
    assert committed and "InvalidRecordError" in failed, (committed, failed)
    print(f"produce: {len(committed)} committed, failed: {sorted(set(failed))}")


def test_kafka_config_values(migrated: str, bootstrap: str, topic: str) -> None:
    """Generated librdkafka settings: the transaction works, or a dualwrite error says why."""
    keys = ["linger.ms", "acks", "message.max.bytes", "compression.type", "batch.size",
            "enable.idempotence", "transaction.timeout.ms", "client.id", "retries",
            "max.in.flight.requests.per.connection", "security.protocol", "no.such.setting"]
    values = st.one_of(st.integers(-1, 5_000_000), st.sampled_from(["all", "1", "lz4", "zstd",
                                                                    "true", "false", "x", ""]),
                       st.booleans(), st.none(), st.floats(allow_nan=True))

    outcomes: list[str] = []

    @settings(max_examples=20, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(extra=st.dictionaries(st.sampled_from(keys), values, max_size=2))
    def transaction(extra: dict[str, Any]) -> None:
        config = {"bootstrap.servers": bootstrap, **extra}

        def write() -> None:
            writer = DualWriter(migrated, config,
                                transactional_id=f"inputs-{uuid.uuid4().hex[:10]}", timeout_s=5)
            try:
                with writer.transaction() as tx:
                    tx.produce(topic, b"settings")
            finally:
                writer.close()
            outcomes.append("committed")

        _only_dualwrite_errors(write, outcomes)

    transaction()
    assert "committed" in outcomes and "ConfigurationError" in outcomes, outcomes
    print(f"settings: {sorted(set(outcomes))}")


def test_cli_options(migrated: str, bootstrap: str, tmp_path: Path) -> None:
    """The CLI exits with a documented code and one error line; never a traceback."""
    db_values = st.one_of(st.just(migrated), st.text(max_size=20), st.sampled_from(
        ["shop.db", "mysql://u:Pw-5ecret@h/db", "postgresql+psycopg2://u@h/db", "sqlite://"]))
    # Only the shared broker or malformed values: a well-formed unknown host would cost a
    # bootstrap timeout per example.
    bootstrap_values = st.one_of(
        st.just(bootstrap), st.text(max_size=12).map(lambda t: f"{t} /{t}"),
        st.sampled_from(["", ",", "host:port", "[::1", "h:99999", ":"]))
    option_values = st.one_of(st.text(max_size=8), st.sampled_from(["-1", "0", "nan", "inf",
                                                                    "3"]))
    verbs = st.sampled_from([["db", "upgrade"], ["status"], ["recover"], ["probe"]])

    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(verb=verbs, db=db_values, servers=bootstrap_values, timeout=option_values,
           extra=st.lists(st.sampled_from(["--prefix", "--json", "--transactional-id",
                                           "--sink-id", "--no-2pc-check", "x", "--", "-v"]),
                          max_size=3))
    def run(verb: list[str], db: str, servers: str, timeout: str, extra: list[str]) -> None:
        args = [*verb]
        if verb != ["probe"]:
            args += ["--db", db]
        if verb != ["db", "upgrade"]:
            args += ["-b", servers, "--timeout", timeout]
        runner = CliRunner()
        with runner.isolated_filesystem(temp_dir=tmp_path):
            result = runner.invoke(cli, [*args, *extra])
        assert result.exception is None or isinstance(result.exception, SystemExit), \
            (args, extra, result.output, result.exc_info)
        assert result.exit_code in (0, 1, 2, 3, 4, 5), (args, result.output)
        if result.exit_code in (1, 4):
            errors = [line for line in result.output.splitlines() if line.startswith("error:")]
            assert len(errors) == 1, (args, result.output)
        assert "Pw-5ecret" not in result.output
        assert "Traceback" not in result.output

    run()
