"""Kafka's own command-line tools, run from Maven jars, for the soak's independent verifier.

:func:`console_consume` reads a topic with Kafka's Java ConsoleConsumer (not librdkafka, not
dualwrite's reader), :func:`list_transactions` and :func:`find_hanging` ask the cluster about
transactions with ``TransactionsCommand`` (``kafka-transactions.sh``). The jars are resolved by
``dualwrite.dev.maven`` from ``kafka-tools.pom.xml`` next to this module and cached like the
broker's. Kafka 3.9.x and 4.x keep both tools in ``kafka-tools`` under the same class names.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import Consumer, IsolationLevel, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

from dualwrite.dev._util import dualwrite_home, find_java
from dualwrite.dev.maven import logging_flavour, major_version, resolve_classpath

__all__ = [
    "CONSOLE_CONSUMER",
    "TRANSACTIONS_COMMAND",
    "ConsoleRecord",
    "KafkaToolError",
    "ToolTransaction",
    "console_consume",
    "find_hanging",
    "list_transactions",
    "tools_classpath",
]

CONSOLE_CONSUMER = "org.apache.kafka.tools.consumer.ConsoleConsumer"
TRANSACTIONS_COMMAND = "org.apache.kafka.tools.TransactionsCommand"
POM = Path(__file__).with_name("kafka-tools.pom.xml")
JVM_OPTIONS = ("-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC",
               "-Djava.awt.headless=true")
TOOL_TIMEOUT_S = 120.0

# Columns of ConsoleConsumer's output (ASCII unit separator) and its null key (record separator):
# neither can occur in the soak's keys and values.
_SEP = "\x1f"
_NULL = "\x1e"
_LINE = re.compile(rf"Partition:(\d+){_SEP}Offset:(\d+){_SEP}([^{_SEP}]*){_SEP}([^{_SEP}]*)")

_LOG4J2 = """\
appender.stderr.type = Console
appender.stderr.name = STDERR
appender.stderr.target = SYSTEM_ERR
appender.stderr.layout.type = PatternLayout
appender.stderr.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = STDERR
"""
_LOG4J1 = """\
log4j.rootLogger=WARN, stderr
log4j.appender.stderr=org.apache.log4j.ConsoleAppender
log4j.appender.stderr.Target=System.err
log4j.appender.stderr.layout=org.apache.log4j.PatternLayout
log4j.appender.stderr.layout.ConversionPattern=[%d] %p %m (%c)%n
"""


class KafkaToolError(RuntimeError):
    """A Kafka tool failed, timed out, printed what cannot be parsed, or read short."""


@dataclass(frozen=True)
class ConsoleRecord:
    """One record as ConsoleConsumer printed it."""

    partition: int
    offset: int
    key: str | None
    value: str


@dataclass(frozen=True)
class ToolTransaction:
    """One row of ``kafka-transactions.sh list``."""

    transactional_id: str
    coordinator_id: int
    producer_id: int
    state: str


def tools_classpath(kafka_version: str) -> str:
    """The classpath of ``org.apache.kafka:kafka-tools:<kafka_version>`` and an SLF4J binding,
    downloaded by Maven the first time and cached under ``$DUALWRITE_HOME/classpath``."""
    # resolve_classpath reads its pom as ``resources.files("dualwrite.dev") / pom_resource``;
    # an absolute path there names this pom (pathlib joins an absolute path as itself).
    jars = resolve_classpath(
        "Kafka-tools", kafka_version, str(POM.resolve()),
        {"kafka.version": kafka_version, "kafka.logging": logging_flavour(kafka_version)},
        coordinates=f"org.apache.kafka:kafka-tools:{kafka_version}")
    return os.pathsep.join(str(j) for j in jars)


def _logging_option(kafka_version: str) -> str:
    """A JVM option pointing the tools' logging at a warnings-to-stderr configuration, so
    stdout carries only the tool's output."""
    folder = dualwrite_home() / "kafka-tools"
    folder.mkdir(parents=True, exist_ok=True)
    if major_version(kafka_version) >= 4:
        path, text, prop = folder / "log4j2.properties", _LOG4J2, "log4j2.configurationFile"
    else:
        path, text, prop = folder / "log4j.properties", _LOG4J1, "log4j.configuration"
    if not path.exists() or path.read_text() != text:
        with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as tmp:
            tmp.write(text)
        Path(tmp.name).replace(path)
    return f"-D{prop}={path.as_uri() if prop == 'log4j.configuration' else path}"


def _run_tool(main_class: str, args: Sequence[str], *, kafka_version: str,
              timeout_s: float) -> str:
    """Run a Kafka tool's ``main_class`` with ``args``; its stdout. KafkaToolError on a non-zero
    exit or a timeout, with the tail of its stderr."""
    cmd = [find_java("Kafka's command-line tools"), *JVM_OPTIONS, _logging_option(kafka_version),
           "-cp", tools_classpath(kafka_version), main_class, *args]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                check=False)
    except subprocess.TimeoutExpired as exc:
        err = (exc.stderr if isinstance(exc.stderr, str)
               else (exc.stderr or b"").decode(errors="replace"))
        raise KafkaToolError(f"{main_class.rsplit('.', 1)[-1]} {' '.join(args)} did not finish "
                             f"within {timeout_s:.0f} s; stderr ends:\n{_tail(err)}") from None
    if result.returncode != 0:
        raise KafkaToolError(f"{main_class.rsplit('.', 1)[-1]} {' '.join(args)} exited with "
                             f"{result.returncode}; stderr ends:\n{_tail(result.stderr)}")
    return result.stdout


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _parse_console(stdout: str) -> list[ConsoleRecord]:
    records: list[ConsoleRecord] = []
    for line in stdout.split("\n")[:-1] if stdout else []:  # not splitlines: it splits at _SEP
        m = _LINE.fullmatch(line)
        if m is None:
            raise KafkaToolError(f"cannot parse a ConsoleConsumer line: {line!r}")
        key = None if m[3] == _NULL else m[3]
        records.append(ConsoleRecord(int(m[1]), int(m[2]), key, m[4]))
    return records


def _end_offsets(bootstrap: str, topic: str, isolation: str,
                 timeout_s: float) -> dict[int, tuple[int, int]]:
    """Each partition's (earliest, end): end is the last stable offset for read_committed, the
    high watermark for read_uncommitted."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    meta = admin.list_topics(topic, timeout=timeout_s).topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        raise KafkaToolError(f"cannot read the partitions of topic {topic!r}: "
                             f"{meta.error if meta is not None else 'no metadata'}")
    level = (IsolationLevel.READ_COMMITTED if isolation == "read_committed"
             else IsolationLevel.READ_UNCOMMITTED)

    def offsets(spec: OffsetSpec, iso: IsolationLevel) -> dict[int, int]:
        futures = admin.list_offsets({TopicPartition(topic, p): spec for p in meta.partitions},
                                     isolation_level=iso, request_timeout=timeout_s)
        return {tp.partition: fut.result().offset for tp, fut in futures.items()}

    start = offsets(OffsetSpec.earliest(), IsolationLevel.READ_UNCOMMITTED)  # type: ignore[no-untyped-call]
    end = offsets(OffsetSpec.latest(), level)  # type: ignore[no-untyped-call]
    return {p: (start[p], end[p]) for p in sorted(meta.partitions)}


def _missed(bootstrap: str, topic: str, isolation: str, ends: dict[int, tuple[int, int]],
            read: dict[int, int], timeout_s: float) -> dict[int, int]:
    """Partitions holding a record the tool did not print below the end taken before it ran:
    partition -> offset of the first such record. Checked with librdkafka from each partition's
    last printed offset on."""
    todo = {p: read.get(p, start - 1) + 1 for p, (start, end) in ends.items()
            if read.get(p, start - 1) + 1 < end}
    if not todo:
        return {}
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"kafka-tools-{uuid.uuid4()}",
                         "isolation.level": isolation, "enable.auto.commit": False,
                         "enable.partition.eof": True, "auto.offset.reset": "error"})
    missed: dict[int, int] = {}
    try:
        consumer.assign([TopicPartition(topic, p, o) for p, o in todo.items()])
        deadline = time.monotonic() + timeout_s
        while todo:
            if time.monotonic() > deadline:
                raise KafkaToolError(f"cannot check where ConsoleConsumer stopped in {topic!r}: "
                                     f"partitions {sorted(todo)} not read within {timeout_s} s")
            for msg in consumer.consume(100, 0.5):
                p, err = msg.partition() or 0, msg.error()
                if p not in todo:
                    continue
                if err is None:
                    if (msg.offset() or 0) < ends[p][1]:
                        missed[p] = msg.offset() or 0
                    del todo[p]
                elif err.code() == KafkaError._PARTITION_EOF:
                    del todo[p]
                elif err.fatal() or not err.retriable():
                    raise KafkaToolError(f"checking {topic!r}: {err.str()}")
            for tp in consumer.position([TopicPartition(topic, p) for p in todo]):
                if tp.partition in todo and tp.offset >= ends[tp.partition][1]:
                    del todo[tp.partition]
    except KafkaException as exc:
        raise KafkaToolError(f"checking where ConsoleConsumer stopped in {topic!r}: {exc}") from exc
    finally:
        consumer.close()
    return missed


def console_consume(bootstrap: str, topic: str, *, kafka_version: str,
                    isolation: str = "read_committed", idle_timeout_s: float = 10.0,
                    timeout_s: float = 300.0) -> list[ConsoleRecord]:
    """Every record of ``topic`` as Kafka's Java ConsoleConsumer reads it from the beginning at
    ``isolation`` (``read_committed`` or ``read_uncommitted``), in print order.

    ConsoleConsumer stops after ``idle_timeout_s`` without a record; this then checks, with a
    librdkafka consumer from each partition's last printed offset, that no record below the end
    taken before the run (read_committed: the last stable offset) was left unread, runs the tool
    once more with twice the idle timeout if one was, and raises KafkaToolError if it still is.
    """
    if isolation not in ("read_committed", "read_uncommitted"):
        raise ValueError(f"isolation must be read_committed or read_uncommitted, not {isolation!r}")
    deadline = time.monotonic() + timeout_s
    ends = _end_offsets(bootstrap, topic, isolation, min(30.0, timeout_s))
    # Kafka 4.2 renamed --property (KIP-1147) and notes the old name's use on stdout.
    minor = tuple(int(n) for n in re.findall(r"\d+", kafka_version)[:2])
    prop = "--formatter-property" if minor >= (4, 2) else "--property"
    idle = idle_timeout_s
    for attempt in (1, 2):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        stdout = _run_tool(CONSOLE_CONSUMER, [
            "--bootstrap-server", bootstrap, "--topic", topic, "--from-beginning",
            "--isolation-level", isolation, "--timeout-ms", str(int(idle * 1000)),
            prop, "print.partition=true", prop, "print.offset=true", prop, "print.key=true",
            prop, f"key.separator={_SEP}", prop, f"null.literal={_NULL}",
        ], kafka_version=kafka_version, timeout_s=left)
        records = _parse_console(stdout)
        last: dict[int, int] = {}
        for r in records:
            if r.offset <= last.get(r.partition, -1):
                raise KafkaToolError(f"ConsoleConsumer printed {topic!r} partition {r.partition} "
                                     f"offset {r.offset} after offset {last[r.partition]}")
            last[r.partition] = r.offset
        missed = _missed(bootstrap, topic, isolation, ends, last,
                         max(5.0, min(60.0, deadline - time.monotonic())))
        if not missed:
            return records
        if attempt == 2:
            break
        idle *= 2
    raise KafkaToolError(
        f"ConsoleConsumer stopped short in {topic!r} ({isolation}, idle timeout {idle:.0f} s): "
        f"first unread record per partition {dict(sorted(missed.items()))}, "
        f"ends {({p: e for p, (_, e) in ends.items()})}")


def _table(stdout: str, headers: Sequence[str], what: str) -> list[list[str]]:
    """The rows of a ``ToolsUtils.prettyPrintTable`` table (tab-separated, space-padded)."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise KafkaToolError(f"{what} printed nothing (expected a header)")
    header = [c.strip() for c in lines[0].rstrip("\t").split("\t")]
    if header[:len(headers)] != list(headers):
        raise KafkaToolError(f"{what} printed an unexpected header {header!r}")
    rows = []
    for ln in lines[1:]:
        row = [c.strip() for c in ln.rstrip("\t").split("\t")]
        if len(row) != len(header):
            raise KafkaToolError(f"cannot parse a {what} row: {ln!r}")
        rows.append(row)
    return rows


def list_transactions(bootstrap: str, *, kafka_version: str) -> list[ToolTransaction]:
    """Every transactional id the coordinators know, with its state (``kafka-transactions.sh
    list``: Empty, Ongoing, PrepareCommit, CompleteCommit, ...)."""
    stdout = _run_tool(TRANSACTIONS_COMMAND, ["--bootstrap-server", bootstrap, "list"],
                       kafka_version=kafka_version, timeout_s=TOOL_TIMEOUT_S)
    rows = _table(stdout, ["TransactionalId", "Coordinator", "ProducerId", "TransactionState"],
                  "kafka-transactions list")
    try:
        return [ToolTransaction(r[0], int(r[1]), int(r[2]), r[3]) for r in rows]
    except ValueError as exc:
        raise KafkaToolError(f"cannot parse kafka-transactions list output: {exc}") from exc


def find_hanging(bootstrap: str, broker_ids: Sequence[int], *, kafka_version: str,
                 max_transaction_timeout_min: int | None = None) -> list[str]:
    """The hanging transactions on the partitions ``broker_ids`` hold a replica of
    (``kafka-transactions.sh find-hanging --broker-id N``), one tab-separated data line each;
    empty when none hang.

    The tool lists a partition's open transaction (DescribeProducers) whose producer last wrote
    to it more than ``--max-transaction-timeout`` minutes ago (15 by default), and reports it
    hanging only if its transactional id is unknown or its coordinator's transaction no longer
    names that partition, i.e. no coordinator will ever write its marker: an Ongoing transaction
    the coordinator still tracks is never hanging, however old.
    """
    lines: list[str] = []
    for broker in broker_ids:
        args = ["--bootstrap-server", bootstrap, "find-hanging", "--broker-id", str(broker)]
        if max_transaction_timeout_min is not None:
            args += ["--max-transaction-timeout", str(max_transaction_timeout_min)]
        stdout = _run_tool(TRANSACTIONS_COMMAND, args, kafka_version=kafka_version,
                           timeout_s=TOOL_TIMEOUT_S)
        _table(stdout, ["Topic", "Partition", "ProducerId"], "kafka-transactions find-hanging")
        lines += [ln.rstrip() for ln in stdout.splitlines()[1:] if ln.strip()]
    return lines
