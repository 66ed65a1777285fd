"""A throwaway PostgreSQL server on a free loopback port, for tests and local development.

The ``binaries`` backend runs ``initdb`` and ``postgres`` from a local installation in a
temporary directory. PostgreSQL refuses to run as root, so as root the server runs as the
``postgres`` user (or ``nobody``). The ``docker`` backend runs the official ``postgres`` image.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from dualwrite.dev._util import (
    DevClusterError,
    LocalServer,
    choose_backend,
    free_ports,
    parent_death_signal,
    pid_alive,
    read_state,
    server_user,
    tail,
    terminate_pid,
    write_state,
)

__all__ = ["DEFAULT_SETTINGS", "DURABLE_SETTINGS", "LocalPostgres", "find_postgres_bindir"]

log = logging.getLogger(__name__)

PgBackend = Literal["auto", "binaries", "docker"]
DATABASE = "dualwrite"
USER = "dualwrite"
DOCKER_IMAGE = "postgres:16"

# Durability is traded for speed: a test database needs none, and these spare each commit its
# flush to disk.
DEFAULT_SETTINGS: dict[str, str] = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_prepared_transactions": "32",
    "max_connections": "100",
    "shared_buffers": "64MB",
}
# ``LocalPostgres(durable=True)``: each commit waits for its flush to disk, as in production.
DURABLE_SETTINGS: dict[str, str] = {
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
}


def find_postgres_bindir() -> Path:
    """The folder holding ``initdb`` and ``postgres``.

    Tried in order: ``$DUALWRITE_PG_BINDIR``, ``pg_config --bindir``, the newest
    ``/usr/lib/postgresql/*/bin``, and ``initdb`` on PATH.
    """
    candidates: list[Path] = []
    if os.environ.get("DUALWRITE_PG_BINDIR"):
        candidates.append(Path(os.environ["DUALWRITE_PG_BINDIR"]))
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            )
            candidates.append(Path(out.stdout.strip()))

    def _version(p: str) -> float:
        try:
            return float(Path(p).parent.name)
        except ValueError:
            return 0.0

    candidates += [
        Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version)[::-1]
    ]
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(initdb).parent)
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "postgres").is_file():
            return bindir
    raise DevClusterError(
        "PostgreSQL server binaries (initdb, postgres) not found: install them (e.g. "
        "`apt-get install postgresql`), set DUALWRITE_PG_BINDIR to their folder, or run a "
        "Docker engine for the docker backend"
    )


def postgres_server_account() -> pwd.struct_passwd | None:
    """The account to run PostgreSQL as: None (ourselves) unless we are root."""
    return server_user("PostgreSQL")


class LocalPostgres(LocalServer):
    """Start and stop a PostgreSQL server with database ``dualwrite`` owned by user ``dualwrite``.

    Authentication is ``trust`` on 127.0.0.1 only; the server exists for tests. With
    ``detach=True`` (``dualwrite dev up --postgres``) the server outlives this process;
    :meth:`save_state` and :meth:`from_state` let another process find and stop it.
    """

    def __init__(
        self,
        data_dir: Path | None = None,
        *,
        settings: Mapping[str, str] | None = None,
        backend: PgBackend = "auto",
        startup_timeout: float = 60.0,
        detach: bool = False,
        standby_of: int | None = None,
        durable: bool = False,
    ) -> None:
        """``standby_of``: the port of a local server (binaries backend) to stream from, as
        :meth:`start_standby` does. ``durable``: :data:`DURABLE_SETTINGS` over the defaults
        (``settings`` still override both), for figures that include each commit's flush."""
        if backend not in ("auto", "binaries", "docker"):
            raise ValueError(f"backend must be 'auto', 'binaries' or 'docker', not {backend!r}")
        self.requested_backend: PgBackend = backend
        self.backend: Literal["binaries", "docker"] | None = None
        self.settings = {**DEFAULT_SETTINGS, **(DURABLE_SETTINGS if durable else {}),
                         **(settings or {})}
        self.startup_timeout = startup_timeout
        self._standby_of = standby_of
        self._given_data_dir = data_dir
        self.data_dir: Path | None = data_dir
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._container: str | None = None
        self._url: str | None = None
        self.detach = detach
        self.pid: int | None = None
        """The server's process id (binaries backend), also for a handle from :meth:`from_state`."""

    def __repr__(self) -> str:
        backend = self.backend or self.requested_backend
        return f"LocalPostgres(backend={backend!r}, url={self._url!r})"

    @property
    def url(self) -> str:
        """SQLAlchemy URL: ``postgresql+psycopg://dualwrite@127.0.0.1:<port>/dualwrite``."""
        if self._url is None:
            raise DevClusterError("PostgreSQL is not started: call start() first")
        return self._url

    @property
    def dsn(self) -> str:
        """libpq connection string (for psycopg directly)."""
        return self.url.replace("postgresql+psycopg://", "postgresql://", 1)

    def start(self) -> None:
        """Create the cluster, start the server and create the ``dualwrite`` database."""
        if self._url is not None:
            raise DevClusterError("PostgreSQL is already started")
        started = time.monotonic()
        self.backend = choose_backend(self.requested_backend, "binaries",
                                      "use backend='binaries'")
        try:
            if self.backend == "docker":
                self._start_docker()
            else:
                self._start_binaries(replica_of=self._standby_of)
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise
        log.info("PostgreSQL ready at %s in %.1f s", self._url, time.monotonic() - started)

    def stop(self) -> None:
        """Fast shutdown (SIGINT: roll back sessions), SIGKILL if it hangs, then remove the data."""
        if self._container is not None:
            subprocess.run(
                ["docker", "rm", "-f", "-v", self._container], capture_output=True, check=False
            )
            self._container = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(2)
                try:
                    self._proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(timeout=10)
            self._proc = None
        elif self.pid is not None:  # a detached server another process started
            terminate_pid(self.pid, 30, "postgres", sig=signal.SIGINT)
        self.pid = None
        if self.data_dir is not None and self.backend == "binaries":
            target = self.data_dir if self._given_data_dir is None else self.data_dir / "pgdata"
            shutil.rmtree(target, ignore_errors=True)
            if self._given_data_dir is None:
                self.data_dir = None
        self._url = None

    def start_standby(self) -> LocalPostgres:
        """A streaming standby of this server (``binaries`` backend), started on a port of its
        own: ``pg_basebackup -R`` into a new folder, then ``postgres`` there. Replication is
        asynchronous; :meth:`promote` makes it a primary. Stop it like any LocalPostgres."""
        if self.backend != "binaries" or self.port is None or self.data_dir is None:
            raise DevClusterError("a standby needs a started server of the binaries backend")
        standby = LocalPostgres(settings=self.settings, backend="binaries",
                                startup_timeout=self.startup_timeout, standby_of=self.port)
        standby.start()
        return standby

    def promote(self, timeout_s: float = 60.0) -> None:
        """End a standby's recovery (``pg_promote``, waiting): it becomes a primary on a new
        timeline."""
        import psycopg

        dsn = f"host=127.0.0.1 port={self.port} user={USER} dbname=postgres"
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_promote(true, %s)", (max(1, int(timeout_s)),))
            promoted = row.fetchone()
        if not promoted or not promoted[0]:
            raise DevClusterError(f"the standby on port {self.port} was not promoted within "
                                  f"{timeout_s:g} s:\n{self.log_text()[-3000:]}")

    def crash(self) -> None:
        """Immediate shutdown (SIGQUIT, as ``pg_ctl stop -m immediate``: no checkpoint, the
        next start replays WAL); the data folder stays until :meth:`stop`."""
        if self._proc is None:
            raise DevClusterError("crash() needs a server of the binaries backend")
        if self._proc.poll() is None:
            self._proc.send_signal(3)
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)

    def log_text(self) -> str:
        """The server log so far."""
        if self._container is not None:
            result = subprocess.run(
                ["docker", "logs", self._container], capture_output=True, text=True, check=False
            )
            return result.stdout + result.stderr
        if self.data_dir is None:
            return ""
        path = self.data_dir / "postgres.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def running(self) -> bool:
        """Whether the server process (or container) is alive."""
        if self._container is not None:
            result = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}",
                                     self._container], capture_output=True, text=True,
                                    check=False)
            return result.stdout.strip() == "true"
        return self.pid is not None and pid_alive(self.pid, "postgres")

    # -- state for detached servers ---------------------------------------------------------

    def save_state(self, path: Path) -> None:
        """Record this server as JSON in ``path`` (atomically), for :meth:`from_state`."""
        state = {"backend": self.backend, "url": self._url, "port": self.port, "pid": self.pid,
                 "container": self._container,
                 "data_dir": str(self.data_dir) if self.data_dir else None,
                 "owns_data_dir": self._given_data_dir is None}
        write_state(path, state)

    @classmethod
    def from_state(cls, path: Path) -> LocalPostgres:
        """A handle on a server another process started and recorded with :meth:`save_state`."""
        state = read_state(path)
        data_dir = Path(state["data_dir"]) if state.get("data_dir") else None
        server = cls(None if state.get("owns_data_dir", True) else data_dir,
                     backend=state["backend"], detach=True)
        server.attach(state, data_dir)
        return server

    def attach(self, state: Mapping[str, Any], data_dir: Path | None) -> None:
        """Point this (unstarted) handle at the server ``state`` describes (:meth:`save_state`)."""
        self.backend = state["backend"]
        self.data_dir = data_dir
        self.port = state.get("port")
        self.pid = state.get("pid")
        self._container = state.get("container")
        self._url = state.get("url")

    # -- internals -------------------------------------------------------------------------

    def _start_binaries(self, replica_of: int | None = None) -> None:
        """initdb (or, with ``replica_of``, a base backup of the server on that port with
        standby settings) and start."""
        bindir = find_postgres_bindir()
        user = postgres_server_account()
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="dualwrite-pg-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        pgdata = self.data_dir / "pgdata"
        if pgdata.exists():
            shutil.rmtree(pgdata)
        if user is not None:
            os.chown(self.data_dir, user.pw_uid, user.pw_gid)
            probe = subprocess.run(
                ["test", "-w", str(self.data_dir)], user=user.pw_uid, group=user.pw_gid,
                extra_groups=[], check=False,
            )  # fmt: skip
            if probe.returncode != 0:
                raise DevClusterError(
                    f"user {user.pw_name!r} cannot write {self.data_dir} (a parent folder is "
                    "not reachable for it); choose a data_dir under /tmp"
                )
        run_as: dict[str, Any] = (
            {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user else {}
        )
        if replica_of is None:
            create = [str(bindir / "initdb"), "-D", str(pgdata), "-U", USER, "--auth=trust",
                      "-E", "UTF8", "--locale=C", "--no-sync"]
        else:
            create = [str(bindir / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(replica_of),
                      "-U", USER, "-D", str(pgdata), "-R", "-X", "stream", "--no-sync",
                      "-c", "fast"]
        made = subprocess.run(create, capture_output=True, text=True, timeout=120, check=False,
                              **run_as)
        if made.returncode != 0:
            raise DevClusterError(f"{Path(create[0]).name} failed:\n{made.stdout}\n{made.stderr}")
        (self.port,) = free_ports(1)
        conf = {
            **self.settings,
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.data_dir}'",
        }
        with (pgdata / "postgresql.conf").open("a", encoding="utf-8") as f:
            f.write("\n# added by dualwrite.dev\n")
            f.writelines(f"{k} = {v}\n" for k, v in conf.items())
        logfile = self.data_dir / "postgres.log"
        with logfile.open("ab") as out:
            if user is not None:
                os.chown(logfile, user.pw_uid, user.pw_gid)
            self._proc = subprocess.Popen(
                [str(bindir / "postgres"), "-D", str(pgdata)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=None if self.detach else parent_death_signal(), **run_as,
            )  # fmt: skip
        self.pid = self._proc.pid
        self._url = f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{DATABASE}"
        self._wait_for_server(
            f"host=127.0.0.1 port={self.port} user={USER} dbname=postgres",
            f"CREATE DATABASE {DATABASE}" if replica_of is None else "SELECT 1",
            what="PostgreSQL",
            log=lambda: tail(self.data_dir / "postgres.log") if self.data_dir else "")

    def _wait_for_server(self, dsn: str, statement: str, *, what: str,
                         log: Callable[[], str]) -> None:
        """Run ``statement`` (autocommit) once the server at ``dsn`` accepts connections."""
        import psycopg

        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise DevClusterError(
                    f"postgres exited with code {self._proc.returncode} during startup:\n{log()}"
                )
            try:
                with psycopg.connect(dsn, autocommit=True, connect_timeout=2) as conn:
                    conn.execute(statement)
                return
            except psycopg.OperationalError as e:
                if time.monotonic() > deadline:
                    raise DevClusterError(
                        f"{what} did not accept connections within {self.startup_timeout} s: "
                        f"{e}\n{log()}"
                    ) from e
            time.sleep(0.1)

    def _start_docker(self) -> None:
        (self.port,) = free_ports(1)
        name = f"dualwrite-pg-{self.port}"
        cmd = ["docker", "run", "-d", "--name", name, "--label", "dualwrite.dev=postgres"]
        cmd += ["-p", f"127.0.0.1:{self.port}:5432", "-e", f"POSTGRES_USER={USER}"]
        cmd += ["-e", f"POSTGRES_DB={DATABASE}", "-e", "POSTGRES_HOST_AUTH_METHOD=trust"]
        cmd.append(DOCKER_IMAGE)
        for key, value in self.settings.items():
            cmd += ["-c", f"{key}={value}"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if result.returncode != 0:
            raise DevClusterError(f"`docker run {DOCKER_IMAGE}` failed: {result.stderr.strip()}")
        self._container = name
        self._url = f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{DATABASE}"
        # The image's first (initdb) server listens on no TCP port, so a TCP connection only
        # succeeds with the final server.
        self._wait_for_server(self.dsn, "SELECT 1", what="PostgreSQL (docker)",
                              log=lambda: self.log_text()[-3000:])
