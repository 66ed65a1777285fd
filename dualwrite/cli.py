"""The ``dualwrite`` command: recover after crashes, inspect, force-terminate, migrate, probe.

Exit codes (stable, for scripts and operators):

==  ==========================================================================
0   everything resolved / the command did what it said / status: nothing in doubt
1   an error that is not one of the below (the message says what to do)
2   bad usage (unknown option, malformed argument); force-terminate of an id the
    coordinator does not know, without --force
3   a heuristic outcome: the database committed, Kafka aborted; a human must act
4   the Kafka cluster or the database could not be reached
5   some transactional ids could not be resolved (recover; see the report; retry), or
    status found a transaction or batch in doubt (run recover)
6   verify found anomalies: rows without records, records without rows, duplicate
    records, or partitions it could not read to the end (an open transaction)
==  ==========================================================================
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
import time
import types
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from dualwrite import metrics
from dualwrite.batch.decision_log import check_sink_id
from dualwrite.database import check_database_file, create_engine, mask_url, upgrade_database
from dualwrite.errors import (
    BrokerUnreachableError,
    ConfigurationError,
    DatabaseUnreachableError,
    DualWriteError,
    HeuristicOutcomeError,
)
from dualwrite.participant.behaviour import check_behaviours
from dualwrite.participant.broker_probe import ApiKey
from dualwrite.participant.client_config import (
    LIBRDKAFKA_LOGGER,
    check_kafka_config,
    load_properties,
)
from dualwrite.participant.control_plane import ControlPlane
from dualwrite.recovery import (
    Condition,
    OpenTransaction,
    RecoveryReport,
    RecoveryResult,
    SinkRecoveryResult,
    StatusReport,
    recover,
    status,
)
from dualwrite.recovery.daemon import RecoveryDaemon
from dualwrite.recovery.resolver import pulsar_rows_left
from dualwrite.recovery.verify import VerifyReport, verify

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_HEURISTIC = 3
EXIT_UNREACHABLE = 4
EXIT_UNRESOLVED = 5
EXIT_ANOMALIES = 6
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention for Ctrl-C

F = TypeVar("F", bound=Callable[..., Any])


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _guarded(fn: F) -> F:
    """Turn dualwrite's exceptions into a message and the documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigurationError as exc:  # a malformed --db, --bootstrap-servers, --timeout …
            _fail(str(exc), EXIT_USAGE)
        except (BrokerUnreachableError, DatabaseUnreachableError) as exc:
            _fail(str(exc), EXIT_UNREACHABLE)
        except HeuristicOutcomeError as exc:
            _fail(str(exc), EXIT_HEURISTIC)
        except DualWriteError as exc:
            _fail(str(exc), EXIT_ERROR)

    return wrapper  # type: ignore[return-value]


def _kafka_config(bootstrap: str | None, properties: str | None) -> dict[str, Any]:
    config: dict[str, Any] = dict(load_properties(properties)) if properties else {}
    if bootstrap:
        config["bootstrap.servers"] = bootstrap
    if "bootstrap.servers" not in config:
        _fail("no Kafka cluster given: pass --bootstrap-servers, a --kafka-properties file with "
              "bootstrap.servers, or set DUALWRITE_BOOTSTRAP_SERVERS", EXIT_USAGE)
    try:
        return check_kafka_config(config)
    except ConfigurationError as exc:
        _fail(str(exc), EXIT_USAGE)


def _check_sink_ids(_ctx: click.Context, _param: click.Parameter,
                    value: tuple[str, ...]) -> tuple[str, ...]:
    try:
        return tuple(check_sink_id(v) for v in value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def kafka_options(fn: F) -> F:
    fn = click.option("--kafka-properties", "kafka_properties", type=click.Path(dir_okay=False),
                      envvar="DUALWRITE_KAFKA_PROPERTIES",
                      help="Kafka client settings (security.protocol, sasl.*, ssl.*) as a "
                      "key=value file, librdkafka names [env DUALWRITE_KAFKA_PROPERTIES].")(fn)
    fn = click.option("--bootstrap-servers", "-b", envvar="DUALWRITE_BOOTSTRAP_SERVERS",
                      help="Kafka bootstrap servers [env DUALWRITE_BOOTSTRAP_SERVERS].")(fn)
    return fn


def pulsar_options(fn: F) -> F:
    fn = click.option("--pulsar-token-file", type=click.Path(dir_okay=False, exists=True),
                      envvar="DUALWRITE_PULSAR_TOKEN_FILE",
                      help="A file holding the Pulsar authentication token "
                      "[env DUALWRITE_PULSAR_TOKEN_FILE].")(fn)
    fn = click.option("--pulsar-url", envvar="DUALWRITE_PULSAR_URL",
                      help="Also the PulsarDualWriter ids, through this Pulsar service URL "
                      "(pulsar://host:port); with it and no Kafka cluster given, only those "
                      "[env DUALWRITE_PULSAR_URL].")(fn)
    return fn


def _kafka_config_unless_pulsar_only(bootstrap: str | None, properties: str | None,
                                     pulsar_url: str | None) -> dict[str, Any] | None:
    """The Kafka config, or None when only a Pulsar URL was given."""
    if pulsar_url and not (bootstrap or properties):
        return None
    return _kafka_config(bootstrap, properties)


DATABASE_URL_ENV = "DUALWRITE_DATABASE_URL"
"""The environment variable naming the database (docker-compose.yml and `dev up` export it)."""
_DEPRECATED_DATABASE_URL_ENV = "DUALWRITE_DB"


def _database_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    """``--db``, else $DUALWRITE_DATABASE_URL, else the deprecated $DUALWRITE_DB (warned)."""
    if value:
        return value
    old = os.environ.get(_DEPRECATED_DATABASE_URL_ENV)
    if old:
        click.echo(f"warning: {_DEPRECATED_DATABASE_URL_ENV} is deprecated; set "
                   f"{DATABASE_URL_ENV} instead", err=True)
        return old
    raise click.MissingParameter(ctx=ctx, param=param)


def db_option(fn: F) -> F:
    return click.option("--db", "db_url", envvar=DATABASE_URL_ENV, callback=_database_url,
                        help="Database URL, e.g. sqlite:///app.db or "
                        f"postgresql://user@host/db [env {DATABASE_URL_ENV}].")(fn)


def timeout_option(fn: F) -> F:
    return click.option("--timeout", "timeout_s", type=click.FloatRange(0, min_open=True),
                        default=30.0, show_default=True,
                        help="Seconds to wait for Kafka and the database per call.")(fn)


class _Main(click.Group):
    """The command group; Ctrl-C in any command exits 130 with one line, not click's
    "Aborted!" and 1 (`recover --watch` handles SIGINT itself and exits 0)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True,
              help="More logging, librdkafka's own lines included (-vv for debug).")
@click.version_option(package_name="dualwrite")
def main(verbose: int) -> None:
    """dualwrite: atomic writes to a SQL database and Kafka (KIP-939 two-phase commit).

    Applications use the library; this command is for operators: finish in-doubt transactions
    after a crash (recover), see what is open and for how long (status), end a stuck
    transaction by force (force-terminate), create the state table (db upgrade), check what a
    cluster supports (probe), and run a local Kafka for development (dev).
    """
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if verbose < 2:
        # kafka-python logs every failed connection attempt; the command's own message says what
        # failed and what to do.
        logging.getLogger("kafka").setLevel(logging.CRITICAL)
    if verbose:
        # librdkafka's own lines (GETPID, REQTMOUT, FAIL ...): quiet by default, see
        # client_config.LIBRDKAFKA_LOGGER.
        logging.getLogger(LIBRDKAFKA_LOGGER).setLevel(level)


@main.command()
@kafka_options
@timeout_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--no-2pc-check", is_flag=True,
              help="Do not send InitProducerId v6 (it fences the id 'dualwrite-probe').")
@click.option("--behaviour-topic", metavar="TOPIC",
              help="Also run one aborted transaction on partition 0 of TOPIC and check, by API "
              "key, each broker behaviour recovery relies on (for another implementation of "
              "the Kafka protocol).")
@_guarded
def probe(bootstrap_servers: str | None, kafka_properties: str | None, timeout_s: float,
          as_json: bool, no_2pc_check: bool, behaviour_topic: str | None) -> None:
    """What a Kafka cluster supports for two-phase commit; the last line is the verdict
    ("dualwrite: supported — epoch-resume mode ..." or what is missing). Exit 0 either way
    (the verdict and --json's "supported" say it), 4 when the cluster cannot be reached."""
    config = _kafka_config(bootstrap_servers, kafka_properties)
    with ControlPlane(config, timeout_s=timeout_s, require_support=False) as cp:
        result = cp.probe(check_2pc=not no_2pc_check)
    behaviours = (check_behaviours(config, behaviour_topic, timeout_s=timeout_s)
                  if behaviour_topic and result.supported else [])
    if as_json:
        doc = result.as_dict()
        if behaviour_topic:
            doc["behaviours"] = [{"behaviour": c.behaviour, "ok": c.ok, "required": c.required,
                                  "detail": c.detail} for c in behaviours]
        click.echo(json.dumps(doc, indent=2))
        return
    for b in result.brokers:
        click.echo(f"broker {b.node_id} at {b.host}:{b.port}: {b.software}")
    def version(key: int) -> str:
        ranges = [b.api_versions.get(key) for b in result.brokers]
        return ", ".join(f"v{r.min_version}-v{r.max_version}" if r else "absent" for r in ranges)
    click.echo(f"transaction.version (finalized): {result.transaction_version}")
    click.echo(f"transaction.max.timeout.ms: {result.max_transaction_timeout_ms}")
    click.echo(f"transaction.two.phase.commit.enable: {result.two_phase_commit_enabled}")
    for key in (ApiKey.INIT_PRODUCER_ID, ApiKey.END_TXN, ApiKey.DESCRIBE_PRODUCERS,
                ApiKey.DESCRIBE_TRANSACTIONS, ApiKey.LIST_TRANSACTIONS):
        click.echo(f"{key.request_name:>22}: {version(key)}")
    click.echo(f"InitProducerId v6 Enable2Pc: {result.enable_2pc}")
    click.echo(f"InitProducerId v6 KeepPreparedTxn: {result.keep_prepared_txn}")
    for c in behaviours:
        mark = "ok" if c.ok else ("NO" if c.required else "no (anchors are read instead)")
        click.echo(f"{c.behaviour}: {mark} ({c.detail})")
    click.echo(result.verdict)


@main.command(name="recover")
@db_option
@kafka_options
@timeout_option
@click.option("--transactional-id", "-t", "transactional_ids", multiple=True,
              help="Only these ids (repeatable); default: every id in the state table.")
@click.option("--sink", "-s", "sink_ids", multiple=True, callback=_check_sink_ids,
              help="Only these batch sinks (repeatable); default: every sink in the decision "
              "log, or none when -t is given.")
@click.option("--parallelism", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option("--acknowledge-heuristic", is_flag=True,
              help="Clear heuristic-abort and outcome-unreadable states (and complete a batch "
              "sink's heuristic batch) after you re-published their missing records.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report.")
@click.option("--watch", "watch_s", type=click.FloatRange(0, min_open=True), metavar="INTERVAL",
              help="Run as a daemon: a pass (recover, then status) every INTERVAL seconds, one "
              "line per pass, until SIGTERM or SIGINT (exit 0). Failed passes (Kafka or the "
              "database unreachable, ids unresolved) are retried with exponential back-off.")
@click.option("--max-backoff", "max_backoff_s", type=click.FloatRange(0, min_open=True),
              default=300.0, show_default=True,
              help="With --watch: the longest wait after failed passes (at least INTERVAL).")
@click.option("--metrics-port", type=click.IntRange(1, 65535),
              help="With --watch: serve Prometheus metrics at http://HOST:PORT/metrics "
              "(needs dualwrite[metrics]).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="With --metrics-port: the address to bind.")
@pulsar_options
@_guarded
def recover_command(db_url: str, bootstrap_servers: str | None, kafka_properties: str | None,
                    timeout_s: float, transactional_ids: tuple[str, ...],
                    sink_ids: tuple[str, ...], parallelism: int, acknowledge_heuristic: bool,
                    as_json: bool, watch_s: float | None, max_backoff_s: float,
                    metrics_port: int | None, metrics_host: str, pulsar_url: str | None,
                    pulsar_token_file: str | None) -> None:
    """Commit or abort every in-doubt transaction, as the database decided.

    Batch sinks (the Spark sink): commits the participants of a decided, not completed batch
    and aborts every other open transaction of the sink's id pool, under the sink's decision
    lock. It may run beside the sink's running query: a batch being decided is kept, a batch
    not yet decided may be aborted and is then written again (a running sink also recovers
    itself when it starts).

    Exit 0 when all are resolved, 3 on a heuristic outcome, 1 when an id failed with an error
    retrying will not fix (e.g. a missing ACL), 4 when Kafka or the database cannot be reached,
    5 when some ids or sinks are still unresolved. With --watch: exit 0 on SIGTERM or SIGINT.

    PulsarDualWriter ids (their rows name Pulsar transactions) are recovered with --pulsar-url
    and reported as unresolved without it.
    """
    config = _kafka_config_unless_pulsar_only(bootstrap_servers, kafka_properties, pulsar_url)
    token = _read_token(pulsar_token_file) if pulsar_token_file else None
    if pulsar_url:
        _pulsar_recovery()  # the extra it needs, before any work
    check_database_file(db_url)
    engine = create_engine(db_url)
    ids = list(transactional_ids) or None
    sinks = list(sink_ids) or None
    if watch_s is None and metrics_port is not None:
        _fail("--metrics-port needs --watch (`dualwrite status --prometheus` prints the "
              "metrics once)", EXIT_USAGE)
    if watch_s is not None:
        stop_metrics = metrics.serve(metrics_port, metrics_host) \
            if metrics_port is not None else None
        click.echo(f"recovery daemon: {mask_url(db_url)}, a pass every {watch_s:g} s"
                   + (f", metrics at http://{metrics_host}:{metrics_port}/metrics"
                      if metrics_port is not None else ""))

        def one_pass() -> tuple[RecoveryReport, StatusReport]:
            report = _recover_all(engine, config, pulsar_url, token, ids, sinks, parallelism,
                                  timeout_s, acknowledge_heuristic)
            return report, (status(engine, config, timeout_s=timeout_s) if config is not None
                            else StatusReport((), ()))

        RecoveryDaemon(one_pass, watch_s, max(max_backoff_s, watch_s)).run()
        if stop_metrics is not None:
            stop_metrics()
        return
    show_bar = not as_json and sys.stderr.isatty()
    bar_ctx = click.progressbar(length=len(ids) if ids else 0, label="recovering",
                                file=sys.stderr) if show_bar and ids else None

    def progress(result: RecoveryResult) -> None:
        if bar_ctx is not None:
            bar_ctx.update(1)

    report = _recover_all(engine, config, pulsar_url, token, ids, sinks, parallelism, timeout_s,
                          acknowledge_heuristic, progress)
    if bar_ctx is not None:
        bar_ctx.render_finish()
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        for r in report.results:
            line = f"{r.transactional_id}: {r.outcome.value}"
            click.echo(line + (f" — {r.detail}" if r.detail else ""))
        for s in report.sinks:
            click.echo(_sink_line(s))
        counts = ", ".join(f"{k}={v}" for k, v in report.as_dict()["counts"].items())
        click.echo(f"{len(report.results)} transactional ids"
                   + (f", {len(report.sinks)} batch sinks" if report.sinks else "")
                   + f" in {report.elapsed_s:.2f} s" + (f": {counts}" if counts else ""))
    for s in report.heuristic_sinks:
        click.echo(f"error: {s.detail}", err=True)
    if report.heuristic or report.heuristic_sinks:
        sys.exit(EXIT_HEURISTIC)
    if any(r.fatal for r in report.failed):
        sys.exit(EXIT_ERROR)  # retrying will not help: the message says what to fix
    if any(r.unreachable for r in report.failed) \
            or any(s.unreachable for s in report.failed_sinks):
        sys.exit(EXIT_UNREACHABLE)
    if report.failed or report.failed_sinks:
        sys.exit(EXIT_UNRESOLVED)


def _read_token(path: str) -> str | None:
    """The token in ``path`` (None if the file is empty); never echoed."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError as exc:
        _fail(f"cannot read the Pulsar token file {path}: {exc.strerror}", EXIT_USAGE)


def _pulsar_recovery() -> types.ModuleType:
    """``dualwrite.recovery.pulsar``, or a usage error naming the extra it needs."""
    try:
        import dualwrite.recovery.pulsar as module
    except ImportError as exc:
        _fail(f"--pulsar-url needs the `pulsar` extra ({exc.name or exc} is missing): pip "
              "install 'dualwrite[pulsar]'", EXIT_USAGE)
    return module


def _recover_all(engine: Any, config: dict[str, Any] | None, pulsar_url: str | None,
                 token: str | None, ids: list[str] | None, sinks: list[str] | None,
                 parallelism: int, timeout_s: float, acknowledge_heuristic: bool,
                 progress: Callable[[RecoveryResult], None] | None = None) -> RecoveryReport:
    """Kafka's ids and sinks (``config``), and PulsarDualWriter ids (``pulsar_url``), in one
    report; without a Pulsar URL, ids whose rows name Pulsar transactions are reported failed
    (not skipped silently)."""
    started = time.monotonic()
    pulsar: tuple[RecoveryResult, ...] = ()
    if pulsar_url:
        pulsar = _pulsar_recovery().recover_pulsar(
            engine, pulsar_url, ids, token=token, timeout_s=timeout_s,
            acknowledge_heuristic=acknowledge_heuristic).results
    else:
        pulsar = tuple(pulsar_rows_left(engine, ids))
    if config is None:
        return RecoveryReport(pulsar, time.monotonic() - started)
    kafka_ids = ids
    if ids is not None:  # the Pulsar rows among them are done above
        done = {r.transactional_id for r in pulsar}
        kafka_ids = [i for i in ids if i not in done]
    kafka = recover(engine, config, kafka_ids, sink_ids=sinks, parallelism=parallelism,
                    timeout_s=timeout_s, acknowledge_heuristic=acknowledge_heuristic,
                    progress=progress)
    return RecoveryReport(pulsar + kafka.results, time.monotonic() - started, kafka.sinks)


def _sink_line(s: SinkRecoveryResult) -> str:
    batch = f"batch {s.batch_id}" if s.batch_id is not None else "no decided batch"
    line = f"sink {s.sink_id} {batch}: {s.outcome.value}"
    done = []
    if s.committed:
        done.append(f"committed {s.committed} participants")
    if s.aborted:
        done.append(f"aborted {len(s.aborted)} lingering ({', '.join(s.aborted)})")
    if done:
        line += f" ({'; '.join(done)})"
    return line + (f" — {s.detail}" if s.detail else "")


@main.command(name="status")
@db_option
@kafka_options
@timeout_option
@click.option("--prefix", help="Look for hanging transactions only among ids with this prefix "
              "(batch sinks are always shown).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--prometheus", is_flag=True,
              help="Print dualwrite's metrics in the Prometheus text format instead (in doubt, "
              "heuristic, longest-open transaction); exit 0 unless a side is unreachable (4).")
@pulsar_options
@_guarded
def status_command(db_url: str, bootstrap_servers: str | None, kafka_properties: str | None,
                   timeout_s: float, prefix: str | None, as_json: bool,
                   prometheus: bool, pulsar_url: str | None,
                   pulsar_token_file: str | None) -> None:
    """What is in doubt: each id of the state table classified against the brokers' view,
    batch sinks' last batches, and hanging (open, unowned) transactions.

    \b
    Each id is one of:
      in-doubt             a decision is still to be carried out (an open transaction to
                           commit or abort, or an outcome to confirm): run `dualwrite recover`
      completed            committed at the broker; its writer stopped without close()
      left-to-live-writer  a live writer holds the id's lease and finishes it itself
      heuristic            Kafka aborted what the database decided to commit
      clear                nothing stored, nothing open

    Exit 0 when nothing is in doubt, 5 when an id or a batch sink is in doubt, 3 on a heuristic
    outcome, 4 when Kafka or the database cannot be reached. Hanging transactions are listed,
    not counted: they may belong to live producers that dualwrite does not know. With
    --pulsar-url, PulsarDualWriter ids are classified by what their anchor says (without it
    they are in doubt: status cannot tell).
    """
    if prometheus and as_json:
        _fail("--json and --prometheus exclude each other: --prometheus prints the metrics in "
              "the Prometheus text format", EXIT_USAGE)
    config = _kafka_config_unless_pulsar_only(bootstrap_servers, kafka_properties, pulsar_url)
    token = _read_token(pulsar_token_file) if pulsar_token_file else None
    if pulsar_url:
        _pulsar_recovery()  # the extra it needs, before any work
    check_database_file(db_url)
    if prometheus and not metrics.ENABLED:
        _fail("--prometheus needs prometheus_client: pip install 'dualwrite[metrics]'",
              EXIT_USAGE)
    engine = create_engine(db_url)
    report = (status(engine, config, prefix=prefix, timeout_s=timeout_s) if config is not None
              else StatusReport((), ()))
    if pulsar_url:
        pulsar_rows = _pulsar_recovery().pulsar_status(engine, pulsar_url, token=token,
                                                       timeout_s=timeout_s)
        named = {r.transactional_id for r in pulsar_rows}
        report = dataclasses.replace(report, rows=tuple(
            r for r in report.rows if r.transactional_id not in named) + pulsar_rows)
    if prometheus:
        metrics.status_observed(len(report.in_doubt) + len(report.sinks_in_doubt),
                                len(report.heuristic),
                                report.active_transaction_open_time_max_ms / 1000)
        click.echo(metrics.exposition(), nl=False)
        return
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        _print_status(report)
    if report.heuristic:
        sys.exit(EXIT_HEURISTIC)
    if report.in_doubt or report.sinks_in_doubt:
        sys.exit(EXIT_UNRESOLVED)


def _print_status(report: StatusReport) -> None:
    rows = [(r.transactional_id, r.condition.value if r.condition else "?",
             r.broker.state.value if r.broker else "unknown",
             f"{r.open_for_ms / 1000:.1f}s" if r.open_for_ms is not None else "-")
            for r in report.rows]
    # Columns as wide as their longest cell (a long transactional id must not shift the rest).
    w_id, w_cond, w_state, w_open = (
        max([len(head)] + [len(row[i]) for row in rows])
        for i, head in enumerate(("transactional id", "condition", "broker state", "open for")))
    click.echo(f"{'transactional id':<{w_id}} {'condition':<{w_cond}} "
               f"{'broker state':<{w_state}} {'open for':>{w_open}}  prepared state")
    for r, (tid, condition, state, open_for) in zip(report.rows, rows, strict=True):
        click.echo(f"{tid:<{w_id}} {condition:<{w_cond}} {state:<{w_state}} "
                   f"{open_for:>{w_open}}  {r.state or '(none)'}")
        if r.detail and r.condition is not Condition.CLEAR:
            click.echo(f"{'':<{w_id + 2}}{r.detail}")
    counts = ", ".join(f"{k}={v}" for k, v in report.as_dict()["counts"].items())
    click.echo(f"in doubt: {len(report.in_doubt)}"
               + (f" ({counts})" if counts else "")
               + f"; ActiveTransactionOpenTimeMaxMs: "
               f"{report.active_transaction_open_time_max_ms}")
    if report.hanging:
        click.echo("hanging (open at the broker, no state row):")
        for h in report.open_transactions:
            click.echo(f"  {h}")
    else:
        click.echo("hanging: none")
    if report.sinks:
        click.echo(f"batch sinks: {len(report.sinks)}, batches in doubt: "
                   f"{len(report.sinks_in_doubt)}")
    for s in report.sinks:
        state = "in doubt" if s.in_doubt else "completed"
        click.echo(f"  sink {s.sink_id}: batch {s.last_batch_id} {state}, decided "
                   f"{s.decided_age_s():.1f}s ago, {len(s.participants)} participants")
        for p in s.participants:
            b = p.broker
            opened = b.open_for_ms() if b is not None else None
            shown = f"{opened / 1000:.1f}s" if opened is not None else "-"
            click.echo(f"    p{p.partition_id} {p.transactional_id:<40} "
                       f"{(b.state.value if b else 'unknown'):<15} {shown:>10}  {p.state}")
        for d in s.lingering:
            click.echo(f"    lingering: {OpenTransaction.of(d)}")
        for t in s.prepared:
            role = "participant" if s.prepared_is_participant(t.gid) else "lingering"
            click.echo(f"    prepared rows ({role}): {t.gid}, holding its locks for "
                       f"{t.held_s():.1f}s")


@main.command(name="force-terminate")
@kafka_options
@timeout_option
@click.option("--transactional-id", "-t", "transactional_id", required=True)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option("--force", is_flag=True,
              help="Also for an id the coordinator does not know (this creates it there).")
@_guarded
def force_terminate(bootstrap_servers: str | None, kafka_properties: str | None,
                    timeout_s: float, transactional_id: str, yes: bool, force: bool) -> None:
    """Abort the open transaction of an id and fence its producer (KIP-939's
    forceTerminateTransaction). Records of that transaction are lost even if a database decided
    to commit it: prefer `dualwrite recover`.

    An id the coordinator does not know (mistyped?) is refused with exit 2 unless --force:
    fencing it would create producer state for it at the broker.
    """
    config = _kafka_config(bootstrap_servers, kafka_properties)
    with ControlPlane(config, timeout_s=timeout_s) as cp:
        before = cp.describe_transaction(transactional_id)
        if before is None and not force:
            _fail(f"the coordinator does not know transactional id {transactional_id!r} "
                  "(mistyped?): nothing to terminate, nothing done. --force fences it anyway, "
                  "which creates the id at the broker", EXIT_USAGE)
        if not yes and not click.confirm(f"Abort the open transaction of {transactional_id!r} "
                                         "and fence its producer?"):
            _fail("not confirmed", EXIT_ERROR)
        identity = cp.fence(transactional_id)
    was = f"{before.state.value} (producer_id={before.producer_id}, epoch={before.epoch})" \
        if before else "unknown to the coordinator"
    click.echo(f"{transactional_id}: was {was}; now producer_id={identity.producer_id} "
               f"epoch={identity.epoch}, no open transaction")


@main.command(name="verify")
@db_option
@kafka_options
@click.option("--table", required=True, help="The table (schema.table allowed).")
@click.option("--key", "key_column", required=True,
              help="Its column holding each row's record key (compared as text).")
@click.option("--topic", required=True, help="The topic of the table's records.")
@click.option("--where", help="An SQL condition selecting the rows that have records.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0, min_open=True), default=60.0,
              show_default=True, help="Seconds to read the topic to its end, the wait for "
              "transactions open at the start included.")
@click.option("--limit-report", "limit", type=click.IntRange(0), default=10, show_default=True,
              help="Example keys shown per anomaly.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@_guarded
def verify_command(db_url: str, bootstrap_servers: str | None, kafka_properties: str | None,
                   table: str, key_column: str, topic: str, where: str | None,
                   timeout_s: float, limit: int, as_json: bool) -> None:
    """Check a table against its topic: each row should have exactly one record (read_committed)
    whose key is the row's KEY column, and each record a row.

    Reports rows without records (lost), records without rows (phantoms), keys with more than
    one record (duplicates) and partitions a transaction kept open past --timeout (run
    `dualwrite status`). The last line is the verdict, `verified: lost=0 duplicates=0 open=0`
    when all is well. Exit 0 when it is, 6 on anomalies, 2 for a missing table, column or
    topic, 4 when Kafka or the database cannot be reached.
    """
    config = _kafka_config(bootstrap_servers, kafka_properties)
    last = [time.monotonic()]

    def progress(done: int, total: int) -> None:
        if time.monotonic() - last[0] >= 2.0:
            last[0] = time.monotonic()
            click.echo(f"read {done} records of {total}", err=True)

    report = verify(db_url, config, table=table, key_column=key_column, topic=topic,
                    where=where, timeout_s=timeout_s, progress=progress)
    if as_json:
        click.echo(json.dumps(report.as_dict(limit), indent=2))
    else:
        _print_verify(report, limit)
    if not report.ok:
        sys.exit(EXIT_ANOMALIES)


def _print_verify(report: VerifyReport, limit: int) -> None:
    click.echo(f"{report.rows} rows in {report.table} (key {report.key_column}), "
               f"{report.records} records in {report.topic} (read_committed), "
               f"{report.elapsed_s:.1f} s")
    duplicates = tuple(f"{k} ({n}x)" for k, n in report.duplicates)
    for label, keys in (("lost (row without record)", report.lost),
                        ("phantoms (record without row)", report.phantoms),
                        ("duplicates (keys with more records)", duplicates),
                        ("rows sharing a key", report.duplicate_rows)):
        shown = ", ".join(keys[:limit]) + (", ..." if len(keys) > limit else "")
        click.echo(f"{label}: {len(keys)}" + (f": {shown}" if keys and limit else ""))
    for label, parts in (("partitions kept open by a transaction", report.open_partitions),
                         ("partitions not read to the end in time", report.unread_partitions)):
        if parts:
            click.echo(f"{label}: {', '.join(map(str, parts))}")
    if report.skipped_records or report.null_key_rows:
        click.echo(f"not compared: {report.skipped_records} records without key, "
                   f"{report.null_key_rows} rows with a NULL key")
    click.echo(report.summary)


@main.group()
def db() -> None:
    """The dualwrite state table in your database."""


@db.command(name="upgrade")
@db_option
@_guarded
def db_upgrade(db_url: str) -> None:
    """Create or migrate the state table (Alembic, own version table)."""
    started = time.monotonic()
    revision = upgrade_database(db_url)
    click.echo(f"{mask_url(db_url)} is at revision {revision} "
               f"({time.monotonic() - started:.2f} s)")


def _attach_dev() -> None:
    try:
        from dualwrite.dev.cli import dev
    except ImportError:  # pragma: no cover - the dev package ships with dualwrite
        return
    main.add_command(dev)


_attach_dev()

if __name__ == "__main__":  # pragma: no cover
    main()
