"""A throwaway MariaDB server on a free loopback port, for tests and local development.

Runs ``mariadb-install-db`` and ``mariadbd`` from a local installation (Debian's
``mariadb-server``) in a temporary directory, the way :class:`~dualwrite.dev.LocalPostgres`
runs PostgreSQL: TCP on 127.0.0.1 only, the unix socket in the temporary directory, no other
configuration file read (``--no-defaults``). As root the server runs as the ``mysql`` user (or
``nobody``). The database ``dualwrite`` belongs to user ``dualwrite``, who has no password: the
server exists for tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dualwrite.dev._util import (
    DevClusterError,
    LocalServer,
    free_ports,
    parent_death_signal,
    pid_alive,
    read_state,
    server_user,
    tail,
    terminate_pid,
    write_state,
)

__all__ = ["DEFAULT_MARIADB_SETTINGS", "LocalMariaDB", "find_mariadb_binaries"]

log = logging.getLogger(__name__)

DATABASE = "dualwrite"
USER = "dualwrite"

#: Durability traded for speed (a test database needs none); no binary log.
DEFAULT_MARIADB_SETTINGS: dict[str, str] = {
    "innodb-flush-log-at-trx-commit": "2",
    "innodb-buffer-pool-size": "64M",
    "innodb-log-file-size": "48M",
    "skip-log-bin": "",
    "skip-name-resolve": "",
    "max-connections": "200",
    "performance-schema": "OFF",
}


def find_mariadb_binaries() -> tuple[Path, Path]:
    """``mariadb-install-db`` and ``mariadbd`` (or ``mysqld``): ``$DUALWRITE_MARIADB_BINDIR``
    first, then PATH, ``/usr/sbin`` and ``/usr/bin``."""
    folders = [os.environ["DUALWRITE_MARIADB_BINDIR"]] if os.environ.get(
        "DUALWRITE_MARIADB_BINDIR") else []
    folders += [*os.environ.get("PATH", "").split(os.pathsep), "/usr/sbin", "/usr/bin"]

    def find(*names: str) -> Path | None:
        for folder in folders:
            for name in names:
                found = shutil.which(name, path=folder)
                if found:
                    return Path(found)
        return None

    install = find("mariadb-install-db", "mysql_install_db")
    server = find("mariadbd", "mysqld")
    if install is None or server is None:
        raise DevClusterError(
            "MariaDB server binaries (mariadb-install-db, mariadbd) not found: install them "
            "(`apt-get install mariadb-server`) or set DUALWRITE_MARIADB_BINDIR to their folder")
    return install, server


class LocalMariaDB(LocalServer):
    """Start and stop a MariaDB server with database ``dualwrite`` owned by user ``dualwrite``.

    With ``detach=True`` (``dualwrite dev up --mariadb``) the server outlives this process;
    :meth:`save_state` and :meth:`from_state` let another process find and stop it.
    """

    def __init__(self, data_dir: Path | None = None, *,
                 settings: Mapping[str, str] | None = None, startup_timeout: float = 60.0,
                 detach: bool = False) -> None:
        self.settings = {**DEFAULT_MARIADB_SETTINGS, **(settings or {})}
        self.startup_timeout = startup_timeout
        self._given_data_dir = data_dir
        self.data_dir: Path | None = data_dir
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._url: str | None = None
        self.detach = detach
        self.pid: int | None = None
        """The server's process id, also for a handle from :meth:`from_state`."""

    def __repr__(self) -> str:
        return f"LocalMariaDB(url={self._url!r})"

    @property
    def url(self) -> str:
        """SQLAlchemy URL: ``mysql+pymysql://dualwrite@127.0.0.1:<port>/dualwrite``."""
        if self._url is None:
            raise DevClusterError("MariaDB is not started: call start() first")
        return self._url

    @property
    def socket_path(self) -> Path:
        """The server's unix socket (in its temporary directory)."""
        if self.data_dir is None:
            raise DevClusterError("MariaDB is not started: call start() first")
        return self.data_dir / "mariadb.sock"

    def start(self) -> None:
        """Create the data directory, start the server, create the user and the database."""
        if self._url is not None:
            raise DevClusterError("MariaDB is already started")
        started = time.monotonic()
        try:
            self._start()
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise
        log.info("MariaDB ready at %s in %.1f s", self._url, time.monotonic() - started)

    def stop(self) -> None:
        """Shut down (SIGTERM: a clean shutdown), SIGKILL if it hangs, then remove the data."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(timeout=10)
            self._proc = None
        elif self.pid is not None:  # a detached server another process started
            terminate_pid(self.pid, 30, "mariadbd", sig=signal.SIGTERM)
        self.pid = None
        if self.data_dir is not None:
            target = self.data_dir if self._given_data_dir is None else self.data_dir / "data"
            shutil.rmtree(target, ignore_errors=True)
            if self._given_data_dir is None:
                self.data_dir = None
        self._url = None

    def crash(self) -> None:
        """SIGKILL the server, as a power cut would stop it (InnoDB recovers from its redo log
        at the next start); the data stays until :meth:`stop`."""
        if self._proc is None:
            raise DevClusterError("crash() needs a server this process started")
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=30)

    def restart(self) -> None:
        """Start the server again on the same data and port (after :meth:`crash`, or stopping
        it if it runs); returns once it accepts connections."""
        if self._url is None:
            raise DevClusterError("MariaDB is not started: call start() first")
        self.crash()
        self._launch()
        self._wait_for_connections().close()

    def log_text(self) -> str:
        """The server's error log so far."""
        if self.data_dir is None:
            return ""
        path = self.data_dir / "mariadb.err"
        return path.read_text(errors="replace") if path.exists() else ""

    def running(self) -> bool:
        """Whether the server process is alive."""
        return self.pid is not None and pid_alive(self.pid, "mariadbd")

    def save_state(self, path: Path) -> None:
        """Record this server as JSON in ``path`` (atomically), for :meth:`from_state`."""
        state = {"url": self._url, "port": self.port, "pid": self.pid,
                 "data_dir": str(self.data_dir) if self.data_dir else None,
                 "owns_data_dir": self._given_data_dir is None}
        write_state(path, state)

    @classmethod
    def from_state(cls, path: Path) -> LocalMariaDB:
        """A handle on a server another process started and recorded with :meth:`save_state`."""
        state = read_state(path)
        data_dir = Path(state["data_dir"]) if state.get("data_dir") else None
        server = cls(None if state.get("owns_data_dir", True) else data_dir, detach=True)
        server.attach(state, data_dir)
        return server

    def attach(self, state: Mapping[str, Any], data_dir: Path | None) -> None:
        """Point this (unstarted) handle at the server ``state`` describes (:meth:`save_state`)."""
        self.data_dir = data_dir
        self.port = state.get("port")
        self.pid = state.get("pid")
        self._url = state.get("url")

    # -- internals -------------------------------------------------------------------------

    def _start(self) -> None:
        install, _ = find_mariadb_binaries()
        user = server_user("mariadbd", "mysql")
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="dualwrite-mariadb-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        data = self.data_dir / "data"
        if data.exists():
            shutil.rmtree(data)
        run_as: list[str] = []
        if user is not None:
            os.chown(self.data_dir, user.pw_uid, user.pw_gid)
            run_as = [f"--user={user.pw_name}"]
        made = subprocess.run(
            [str(install), "--no-defaults", f"--datadir={data}", *run_as,
             "--auth-root-authentication-method=normal", "--skip-test-db"],
            capture_output=True, text=True, timeout=120, check=False)
        if made.returncode != 0:
            raise DevClusterError(f"mariadb-install-db failed:\n{made.stdout}\n{made.stderr}")
        (self.port,) = free_ports(1)
        self._launch()
        self._wait_and_create()
        self._url = f"mysql+pymysql://{USER}@127.0.0.1:{self.port}/{DATABASE}"

    def _launch(self) -> None:
        """Start ``mariadbd`` on the data directory and port already chosen."""
        assert self.data_dir is not None and self.port is not None
        _, server = find_mariadb_binaries()
        user = server_user("mariadbd", "mysql")
        run_as = [] if user is None else [f"--user={user.pw_name}"]
        options = [f"--{k}={v}" if v else f"--{k}" for k, v in self.settings.items()]
        command = [str(server), "--no-defaults", f"--datadir={self.data_dir / 'data'}", *run_as,
                   f"--port={self.port}", "--bind-address=127.0.0.1",
                   f"--socket={self.socket_path}", f"--pid-file={self.data_dir / 'mariadb.pid'}",
                   f"--log-error={self.data_dir / 'mariadb.err'}", *options]
        self._proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=None if self.detach else parent_death_signal())
        self.pid = self._proc.pid

    def _wait_and_create(self) -> None:
        """Once the server answers on its socket (as root, whose password is empty): create
        the ``dualwrite`` user (any loopback host) and database."""
        conn = self._wait_for_connections()
        with conn, conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE IF NOT EXISTS {DATABASE}")
            for host in ("127.0.0.1", "localhost"):
                cur.execute(f"CREATE USER IF NOT EXISTS '{USER}'@'{host}'")
                # ALL on *.*: tests create a database per test, and KILL needs no more.
                cur.execute(f"GRANT ALL ON *.* TO '{USER}'@'{host}'")

    def _wait_for_connections(self) -> Any:
        """A root connection over the unix socket once the server accepts it."""
        import pymysql

        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise DevClusterError(f"mariadbd exited with code {self._proc.returncode} "
                                      f"during startup:\n{tail(self.data_dir / 'mariadb.err')}"
                                      if self.data_dir else "mariadbd exited during startup")
            try:
                conn = pymysql.connect(unix_socket=str(self.socket_path), user="root",
                                       autocommit=True, connect_timeout=2)
                break
            except pymysql.err.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise DevClusterError(
                        f"MariaDB did not accept connections within {self.startup_timeout} s: "
                        f"{exc}\n{self.log_text()[-3000:]}") from exc
            time.sleep(0.1)
        return conn
