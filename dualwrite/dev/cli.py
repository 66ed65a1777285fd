"""``dualwrite dev up|status|down|create-topic``: a detached local Kafka cluster (or kfake, or
Pulsar standalone; and, with ``--postgres``, a PostgreSQL server, or with ``--mariadb`` a MariaDB
server) for development."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar, cast

import click

from dualwrite.dev._util import DevClusterError, dualwrite_home, pid_alive, port_open
from dualwrite.dev.kafka_cluster import DEFAULT_KAFKA_VERSION, Backend, LocalKafkaCluster
from dualwrite.dev.kfake_broker import LocalKfake, kfake_version
from dualwrite.dev.mariadb_cluster import LocalMariaDB
from dualwrite.dev.postgres_cluster import LocalPostgres
from dualwrite.dev.pulsar_cluster import DEFAULT_PULSAR_VERSION, LocalPulsar
from dualwrite.dev.security import application_acls

__all__ = ["dev", "kfake_state_file", "mariadb_state_file", "postgres_state_file",
           "pulsar_state_file", "state_file"]

#: The database server ``dev up`` may start beside the cluster.
DatabaseServer = LocalPostgres | LocalMariaDB

TWO_PC_CONFIG = {
    "transaction.two.phase.commit.enable": "true",
    "unstable.api.versions.enable": "true",
}


def state_file() -> Path:
    """Where ``dev up`` records the running cluster: ``$DUALWRITE_HOME/dev/cluster.json``."""
    return dualwrite_home() / "dev" / "cluster.json"


def kfake_state_file() -> Path:
    """Where ``dev up --flavour kfake`` records its broker: ``$DUALWRITE_HOME/dev/kfake.json``."""
    return dualwrite_home() / "dev" / "kfake.json"


def pulsar_state_file() -> Path:
    """Where ``dev up --flavour pulsar`` records its broker: ``$DUALWRITE_HOME/dev/pulsar.json``."""
    return dualwrite_home() / "dev" / "pulsar.json"


def postgres_state_file() -> Path:
    """Where ``dev up --postgres`` records its server: ``$DUALWRITE_HOME/dev/postgres.json``."""
    return dualwrite_home() / "dev" / "postgres.json"


def mariadb_state_file() -> Path:
    """Where ``dev up --mariadb`` records its server: ``$DUALWRITE_HOME/dev/mariadb.json``."""
    return dualwrite_home() / "dev" / "mariadb.json"


_Handle = TypeVar("_Handle")


def _load_state(path: Path, load: Callable[[Path], _Handle], what: str) -> _Handle | None:
    """The handle recorded in ``path`` by ``dev up``; None if nothing is recorded."""
    if not path.exists():
        return None
    try:
        return load(path)
    except (ValueError, KeyError, TypeError) as e:
        raise click.ClickException(
            f"cannot read {path} ({e}); stop the {what} by hand and delete the file"
        ) from e


def _load_postgres() -> LocalPostgres | None:
    return _load_state(postgres_state_file(), LocalPostgres.from_state, "server")


def _load_mariadb() -> LocalMariaDB | None:
    return _load_state(mariadb_state_file(), LocalMariaDB.from_state, "server")


def _load_databases() -> list[DatabaseServer]:
    """The database servers ``dev up`` recorded (PostgreSQL, MariaDB)."""
    return [s for s in (_load_postgres(), _load_mariadb()) if s is not None]


def _server_name(server: DatabaseServer) -> str:
    return "MariaDB" if isinstance(server, LocalMariaDB) else "PostgreSQL"


def _start_database(mariadb: bool) -> DatabaseServer:
    """Start (detached) and record a PostgreSQL or, with ``mariadb``, a MariaDB server, after
    stopping a stale one of the same kind."""
    path = mariadb_state_file() if mariadb else postgres_state_file()
    stale = _load_mariadb() if mariadb else _load_postgres()
    if stale is not None:
        stale.stop()
        path.unlink(missing_ok=True)
    server: DatabaseServer = LocalMariaDB(detach=True) if mariadb else LocalPostgres(detach=True)
    server.start()
    return server


def _parse_topic(value: str) -> tuple[str, int]:
    name, _, partitions = value.partition(":")
    if not name or (partitions and not partitions.isdigit()):
        raise click.BadParameter(f"expected NAME or NAME:PARTITIONS, got {value!r}",
                                 param_hint="--topic")
    return name, int(partitions or 3)


def _node_status(cluster: LocalKafkaCluster) -> list[dict[str, Any]]:
    rows = []
    for node in cluster.nodes:
        if cluster.backend == "docker":
            alive = cluster.is_running(node.index)
        else:
            alive = node.pid is not None and pid_alive(node.pid, "kafka.Kafka")
        rows.append(
            {
                "node_id": node.node_id,
                "address": node.address,
                "pid": node.pid,
                "container": node.container,
                "process": alive,
                "port_open": port_open(node.port),
            }
        )
    return rows


def _load() -> LocalKafkaCluster | None:
    return _load_state(state_file(), LocalKafkaCluster.from_state, "brokers")


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log what is being done.")
def dev(verbose: bool) -> None:
    """Run a local Kafka cluster (KRaft) for development and tests."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@dev.command()
@click.option(
    "--flavour", type=click.Choice(["kafka", "kfake", "pulsar"]), default="kafka",
    show_default=True,
    help="kafka: Apache Kafka (KRaft). kfake: franz-go's kfake, an independent implementation "
    "of the Kafka protocol (one in-memory broker, built with `go build` on first use), for "
    "compatibility checks. pulsar: Apache Pulsar standalone with its transaction coordinator "
    f"({DEFAULT_PULSAR_VERSION}, from Maven Central's jars; prints DUALWRITE_PULSAR_URL). "
    "Apache Pulsar's Kafka handler (KoP) is not on Maven Central.",
)  # fmt: skip
@click.option("--brokers", type=click.Choice(["1", "3"]), default="1", show_default=True)
@click.option("--kafka-version", default=DEFAULT_KAFKA_VERSION, show_default=True)
@click.option(
    "--backend", type=click.Choice(["auto", "jars", "docker"]), default="auto", show_default=True
)
@click.option(
    "--two-phase-commit", "two_pc", is_flag=True,
    help="Enable KIP-939 on the brokers (transaction.two.phase.commit.enable and "
    "unstable.api.versions.enable).",
)  # fmt: skip
@click.option(
    "--config", "configs", multiple=True, metavar="KEY=VALUE", help="Extra broker setting."
)
@click.option("--timeout", default=180.0, show_default=True, help="Seconds to wait for brokers.")
@click.option(
    "--security", type=click.Choice(["none", "sasl"]), default="none", show_default=True,
    help="sasl: SCRAM-SHA-512 on a SASL_PLAINTEXT and a SASL_SSL listener (a CA made for the "
    "run), ACLs (StandardAuthorizer), and a client properties file for an application "
    "principal with the documented minimal ACLs (jars backend).",
)  # fmt: skip
@click.option(
    "--acl-prefix", default="", metavar="PREFIX",
    help="With --security sasl: the application's topics and transactional ids start with "
    "PREFIX (default: any name).",
)  # fmt: skip
@click.option("--postgres", is_flag=True,
              help="Also start a local PostgreSQL server and print DUALWRITE_DATABASE_URL.")
@click.option("--mariadb", is_flag=True,
              help="Also start a local MariaDB server and print DUALWRITE_DATABASE_URL.")
@click.option("--topic", "topics", multiple=True, metavar="NAME[:PARTITIONS]",
              help="Create this topic once the brokers are up (3 partitions by default).")
@click.option("--json", "as_json", is_flag=True, help="Print the cluster state as JSON.")
def up(
    flavour: str,
    brokers: str,
    kafka_version: str,
    backend: str,
    two_pc: bool,
    configs: tuple[str, ...],
    timeout: float,
    security: str,
    acl_prefix: str,
    postgres: bool,
    mariadb: bool,
    topics: tuple[str, ...],
    as_json: bool,
) -> None:
    """Start a detached cluster and print its bootstrap address (and the exports to use)."""
    if postgres and mariadb:
        raise click.UsageError("--postgres and --mariadb: choose one database server")
    wanted_topics = [_parse_topic(t) for t in topics]
    if flavour == "kfake":
        _up_kfake(wanted_topics, postgres, mariadb, as_json, timeout, configs)
        return
    if flavour == "pulsar":
        _up_pulsar(wanted_topics, postgres, mariadb, as_json, timeout, configs)
        return
    existing = _load()
    if existing is not None:
        if all(row["process"] for row in _node_status(existing)):
            same = (existing.brokers == int(brokers) and existing.kafka_version == kafka_version
                    and bool(existing.security_state()) == (security == "sasl"))
            if not same:
                raise click.ClickException(
                    f"a different dev cluster is already running at "
                    f"{existing.bootstrap_servers}; run `dualwrite dev down` first")
            _reuse(existing, wanted_topics, postgres, mariadb, as_json)
            return
        existing.stop()  # stale state: clean up what is left
        state_file().unlink(missing_ok=True)
    extra = dict(TWO_PC_CONFIG) if two_pc else {}
    for item in configs:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--config")
        extra[key.strip()] = value.strip()
    cluster = LocalKafkaCluster(
        brokers=int(brokers),
        kafka_version=kafka_version,
        data_dir=dualwrite_home() / "dev" / "kafka",
        extra_config=extra,
        backend=cast(Backend, backend),
        detach=True,
        startup_timeout=timeout,
        security="sasl" if security == "sasl" else "none",
    )
    server: DatabaseServer | None = None
    try:
        cluster.start()
        if security == "sasl" and cluster.secrets is not None:
            cluster.create_acls(application_acls(
                cluster.secrets.app.principal, topic_prefix=acl_prefix,
                transactional_id_prefix=acl_prefix))
        for name, partitions in wanted_topics:
            cluster.create_topic(name, partitions)
        if postgres or mariadb:
            server = _start_database(mariadb)
    except BaseException as e:
        if cluster.nodes:
            cluster.stop()
        if server is not None:
            server.stop()
        if isinstance(e, DevClusterError):
            raise click.ClickException(str(e)) from e
        raise
    cluster.save_state(state_file())
    if server is not None:
        server.save_state(mariadb_state_file() if mariadb else postgres_state_file())
    if as_json:
        _echo_json(cluster, wanted_topics, server)
        return
    click.echo(
        f"Kafka {kafka_version} ({brokers} broker(s), {cluster.backend} backend) is up at "
        f"{_bootstrap(cluster)}"
    )
    for name, partitions in wanted_topics:
        click.echo(f"  topic {name} ({partitions} partitions)")
    _echo_security(cluster)
    if isinstance(server, LocalPostgres):
        click.echo(f"PostgreSQL ({server.backend} backend) is up at {server.url}")
    elif server is not None:
        click.echo(f"MariaDB is up at {server.url}")
    _echo_exports(cluster, server)


def _load_kfake() -> LocalKfake | None:
    return _load_state(kfake_state_file(), LocalKfake.from_state, "kfake broker")


def _up_kfake(topics: list[tuple[str, int]], postgres: bool, mariadb: bool, as_json: bool,
              timeout: float, configs: tuple[str, ...]) -> None:
    """``dev up --flavour kfake``: one kfake broker (reused while it runs)."""
    from dualwrite.dev.kafka_cluster import create_topic

    broker = _load_kfake()
    if broker is None or not broker.running():
        if broker is not None:
            broker.stop()
        config = dict(item.partition("=")[::2] for item in configs)
        broker = LocalKfake(data_dir=dualwrite_home() / "dev" / "kfake", broker_config=config,
                            detach=True, startup_timeout=timeout)
        try:
            broker.start()
        except DevClusterError as e:
            raise click.ClickException(str(e)) from e
        broker.save_state(kfake_state_file())
    server: DatabaseServer | None = _load_mariadb() if mariadb else _load_postgres()
    try:
        for name, partitions in topics:
            create_topic(broker.bootstrap_servers, name, partitions)
        if (postgres or mariadb) and (server is None or not server.running()):
            server = _start_database(mariadb)
            server.save_state(mariadb_state_file() if mariadb else postgres_state_file())
    except DevClusterError as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        state = broker.to_state()
        state["topics"] = [name for name, _ in topics]
        state["database_url"] = (server.url if server is not None and (postgres or mariadb)
                                 else None)
        click.echo(json.dumps(state, indent=2))
        return
    click.echo(f"kfake {kfake_version()} (1 broker) is up at "
               f"{broker.bootstrap_servers}")
    click.echo(f"export DUALWRITE_BOOTSTRAP_SERVERS={broker.bootstrap_servers}")
    if server is not None and (postgres or mariadb):
        click.echo(f"export DUALWRITE_DATABASE_URL={server.url}")


def _load_pulsar() -> LocalPulsar | None:
    return _load_state(pulsar_state_file(), LocalPulsar.from_state, "Pulsar broker")


def _up_pulsar(topics: list[tuple[str, int]], postgres: bool, mariadb: bool, as_json: bool,
               timeout: float, configs: tuple[str, ...]) -> None:
    """``dev up --flavour pulsar``: one Pulsar standalone (reused while it runs); ``--topic``
    makes partitioned topics in ``public/default``."""
    broker = _load_pulsar()
    if broker is None or not broker.running():
        if broker is not None:
            broker.stop()
        config = dict(item.partition("=")[::2] for item in configs)
        broker = LocalPulsar(data_dir=dualwrite_home() / "dev" / "pulsar", extra_config=config,
                             detach=True, startup_timeout=timeout)
        try:
            broker.start()
        except DevClusterError as e:
            broker.stop()
            raise click.ClickException(str(e)) from e
        broker.save_state(pulsar_state_file())
    server: DatabaseServer | None = _load_mariadb() if mariadb else _load_postgres()
    try:
        for name, partitions in topics:
            _create_pulsar_topic(broker, name, partitions)
        if (postgres or mariadb) and (server is None or not server.running()):
            server = _start_database(mariadb)
            server.save_state(mariadb_state_file() if mariadb else postgres_state_file())
    except DevClusterError as e:
        raise click.ClickException(str(e)) from e
    database_url = server.url if server is not None and (postgres or mariadb) else None
    if as_json:
        state = broker.to_state()
        state["topics"] = [name for name, _ in topics]
        state["database_url"] = database_url
        click.echo(json.dumps(state, indent=2))
        return
    click.echo(f"Pulsar {broker.version} (standalone, transactions on) is up at "
               f"{broker.service_url} (admin {broker.web_url})")
    for name, partitions in topics:
        click.echo(f"  topic persistent://public/default/{name} ({partitions} partitions)")
    click.echo(f"export DUALWRITE_PULSAR_URL={broker.service_url}")
    if database_url is not None:
        click.echo(f"export DUALWRITE_DATABASE_URL={database_url}")


def _create_pulsar_topic(broker: LocalPulsar, name: str, partitions: int) -> None:
    """A partitioned topic in ``public/default``; one that exists already is kept."""
    try:
        code, answer = broker.admin_request(
            "PUT", f"/admin/v2/persistent/public/default/{name}/partitions", partitions)
    except OSError as e:
        raise DevClusterError(f"Pulsar's admin API at {broker.web_url} did not answer: "
                              f"{e}") from None
    if code not in (204, 409):  # 409: it exists
        raise DevClusterError(f"Pulsar did not create topic {name!r}: HTTP {code} {answer}")


def _echo_json(cluster: LocalKafkaCluster, topics: list[tuple[str, int]],
               server: DatabaseServer | None) -> None:
    state = _json_state(cluster)
    state["topics"] = [name for name, _ in topics]
    state["database_url"] = server.url if server is not None else None
    click.echo(json.dumps(state, indent=2))


def _echo_exports(cluster: LocalKafkaCluster, server: DatabaseServer | None) -> None:
    """The lines a shell evaluates: ``eval "$(dualwrite dev up … | grep '^export')"``."""
    click.echo(f"export DUALWRITE_BOOTSTRAP_SERVERS={_bootstrap(cluster)}")
    if server is not None:
        click.echo(f"export DUALWRITE_DATABASE_URL={server.url}")


def _reuse(cluster: LocalKafkaCluster, topics: list[tuple[str, int]], postgres: bool,
           mariadb: bool, as_json: bool) -> None:
    """``dev up`` while the same cluster runs: create missing topics, start the database server
    if asked and not running, and print the same exports (so a README's `eval "$(dev up …)"` can run
    twice)."""
    from confluent_kafka.admin import AdminClient

    conf: dict[str, Any] = {"bootstrap.servers": cluster.bootstrap_servers,
                            "logger": logging.getLogger("dualwrite.librdkafka.dev")}
    listed = AdminClient(conf).list_topics(timeout=10).topics
    try:
        for name, partitions in topics:
            if name not in listed:
                cluster.create_topic(name, partitions)
    except DevClusterError as e:
        raise click.ClickException(str(e)) from e
    server: DatabaseServer | None = _load_mariadb() if mariadb else _load_postgres()
    if (postgres or mariadb) and (server is None or not server.running()):
        try:
            server = _start_database(mariadb)
        except DevClusterError as e:
            raise click.ClickException(str(e)) from e
        server.save_state(mariadb_state_file() if mariadb else postgres_state_file())
    if as_json:
        _echo_json(cluster, topics, server)
        return
    click.echo(f"Kafka {cluster.kafka_version} is already running at {_bootstrap(cluster)}")
    _echo_security(cluster)
    _echo_exports(cluster, server)


def _json_state(cluster: LocalKafkaCluster) -> dict[str, Any]:
    """The state for ``--json``: a secured cluster's application address and properties file."""
    state = cluster.to_state()
    if state["security"]:
        state["bootstrap_servers"] = _bootstrap(cluster)
        state["client_properties"] = state["security"]["client_properties"]
    return state


def _bootstrap(cluster: LocalKafkaCluster) -> str:
    """The address applications use: the SASL_SSL listener of a secured cluster."""
    sec = cluster.security_state()
    return str(sec["sasl_ssl_bootstrap_servers"]) if sec else cluster.bootstrap_servers


def _echo_security(cluster: LocalKafkaCluster) -> None:
    sec = cluster.security_state()
    if not sec:
        return
    click.echo(f"  SASL_SSL (SCRAM-SHA-512, TLS): {sec['sasl_ssl_bootstrap_servers']}")
    click.echo(f"  SASL_PLAINTEXT (SCRAM-SHA-512): {sec['sasl_plaintext_bootstrap_servers']}")
    click.echo(f"  internal PLAINTEXT (super user, dev tooling only): "
               f"{sec['internal_bootstrap_servers']}")
    click.echo(f"  client properties for {sec['app_principal']}: {sec['client_properties']}")
    click.echo(f"  (SASL_PLAINTEXT: {sec['client_properties_sasl_plaintext']}; "
               f"super user: {sec['admin_properties']}; CA: {sec['ca_file']})")
    click.echo(f"export DUALWRITE_KAFKA_PROPERTIES={sec['client_properties']}")


@dev.command()
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(as_json: bool) -> None:
    """Show whether the dev cluster runs. Exit code 0: all up, 1: some down, 3: none."""
    cluster = _load()
    if cluster is None:
        broker = _load_kfake()
        if broker is not None:
            _broker_status(broker, f"kfake {kfake_version()} (1 broker) at "
                           f"{broker.bootstrap_servers}", as_json)
        pulsar = _load_pulsar()
        if pulsar is not None:
            _broker_status(pulsar, f"Pulsar {pulsar.version} (standalone) at "
                           f"{pulsar.service_url}", as_json)
        if as_json:
            click.echo(json.dumps({"running": False, "nodes": []}))
        else:
            click.echo("no dev cluster (start one with `dualwrite dev up`)")
        sys.exit(3)
    rows = _node_status(cluster)
    up_count = sum(1 for r in rows if r["process"] and r["port_open"])
    if as_json:
        state = _json_state(cluster)
        state.update(running=up_count == len(rows), nodes=rows)
        click.echo(json.dumps(state, indent=2))
    else:
        click.echo(
            f"Kafka {cluster.kafka_version}, {cluster.backend} backend, "
            f"{up_count}/{len(rows)} broker(s) up, bootstrap {_bootstrap(cluster)}"
        )
        _echo_security(cluster)
        for r in rows:
            where = f"pid {r['pid']}" if r["pid"] is not None else f"container {r['container']}"
            state_text = "up" if r["process"] and r["port_open"] else "DOWN"
            click.echo(f"  node {r['node_id']} {r['address']} ({where}): {state_text}")
    pulsar = _load_pulsar()
    if pulsar is not None and not as_json:
        click.echo(f"Pulsar {pulsar.version} (standalone) at {pulsar.service_url}: "
                   f"{'up' if pulsar.running() else 'DOWN'}")
    servers = _load_databases()
    if not as_json:
        _echo_database_servers(servers)
    if any(not server.running() for server in servers) or (pulsar and not pulsar.running()):
        sys.exit(1)
    if up_count == len(rows):
        sys.exit(0)
    sys.exit(1 if up_count else 3)


def _broker_status(broker: LocalKfake | LocalPulsar, where: str, as_json: bool) -> NoReturn:
    """``dev status`` for a ``dev up --flavour kfake|pulsar`` broker (``where`` names it) and
    its database server."""
    up = broker.running()
    servers = _load_databases()
    if as_json:
        state = broker.to_state()
        state["running"] = up
        click.echo(json.dumps(state, indent=2))
    else:
        click.echo(f"{where} (pid {broker.pid}): {'up' if up else 'DOWN'}")
        _echo_database_servers(servers)
    sys.exit(0 if up and all(server.running() for server in servers) else 1)


def _echo_database_servers(servers: list[DatabaseServer]) -> None:
    """``dev status``'s line per database server of the dev cluster."""
    for server in servers:
        click.echo(f"{_server_name(server)} at {server.url}: "
                   f"{'up' if server.running() else 'DOWN'}")


@dev.command()
@click.option("--keep-data", is_flag=True, help="Keep the broker data directories.")
def down(keep_data: bool) -> None:
    """Stop the dev cluster (SIGTERM, then SIGKILL) and its database server; remove their
    data."""
    for server in _load_databases():
        where_db = server.url
        server.stop()
        path = mariadb_state_file() if isinstance(server, LocalMariaDB) else postgres_state_file()
        path.unlink(missing_ok=True)
        click.echo(f"stopped the dev {_server_name(server)} at {where_db}")
    broker = _load_kfake()
    if broker is not None:
        broker.stop()
        kfake_state_file().unlink(missing_ok=True)
        click.echo(f"stopped the dev kfake broker at {broker.bootstrap_servers}")
    pulsar = _load_pulsar()
    if pulsar is not None:
        pulsar.stop()
        pulsar_state_file().unlink(missing_ok=True)
        click.echo(f"stopped the dev Pulsar broker at {pulsar.service_url}")
    cluster = _load()
    if cluster is None:
        if broker is None and pulsar is None:
            click.echo("no dev cluster is running")
        return
    where = cluster.bootstrap_servers
    cluster.stop(keep_data=keep_data)
    state_file().unlink(missing_ok=True)
    click.echo(f"stopped the dev cluster at {where}")


@dev.command(name="create-topic")
@click.argument("name")
@click.option("--partitions", type=click.IntRange(1, 10_000), default=3, show_default=True)
def create_topic_command(name: str, partitions: int) -> None:
    """Create a topic on the running dev cluster (its brokers do not create topics on use)."""
    cluster = _load()
    if cluster is None:
        raise click.ClickException("no dev cluster is running (start one with `dualwrite dev up`)")
    try:
        cluster.create_topic(name, partitions)
    except DevClusterError as e:
        raise click.ClickException(str(e)) from e
    except Exception as e:  # confluent-kafka's KafkaException, e.g. TOPIC_ALREADY_EXISTS
        raise click.ClickException(f"cannot create topic {name!r}: {e}") from e
    click.echo(f"created topic {name} ({partitions} partitions) at {_bootstrap(cluster)}")
