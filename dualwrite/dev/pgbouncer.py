"""A throwaway PgBouncer on a free loopback port, in front of a PostgreSQL server.

Runs Debian's ``pgbouncer`` binary (``apt-get install pgbouncer``) with a configuration written
to a temporary folder: every database of the upstream server, ``auth_type = trust`` (loopback
only; the server exists for tests), and the pool mode asked for (``session``, ``transaction``
or ``statement``). As root it runs as the ``postgres`` user (PgBouncer refuses root), and it
gets SIGKILL when this process dies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from sqlalchemy.engine import make_url

from dualwrite.dev._util import (
    DevClusterError,
    LocalServer,
    free_ports,
    parent_death_signal,
    server_user,
    tail,
)

__all__ = ["LocalPgBouncer", "PoolMode", "find_pgbouncer"]

log = logging.getLogger(__name__)

PoolMode = Literal["session", "transaction", "statement"]


def find_pgbouncer() -> Path:
    """The ``pgbouncer`` executable: ``$DUALWRITE_PGBOUNCER``, PATH, or Debian's
    ``/usr/sbin/pgbouncer``."""
    candidates = [os.environ.get("DUALWRITE_PGBOUNCER"), shutil.which("pgbouncer"),
                  "/usr/sbin/pgbouncer"]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise DevClusterError("pgbouncer not found: install it (e.g. `apt-get install pgbouncer`) "
                          "or set DUALWRITE_PGBOUNCER to the executable")


class LocalPgBouncer(LocalServer):
    """PgBouncer in ``pool_mode`` in front of the server of ``upstream_url`` (an SQLAlchemy or
    libpq URL on 127.0.0.1); :meth:`url` gives the same URL through the pooler."""

    def __init__(self, upstream_url: str, *, pool_mode: PoolMode = "session",
                 pool_size: int = 20, settings: dict[str, str] | None = None,
                 startup_timeout: float = 30.0) -> None:
        if pool_mode not in ("session", "transaction", "statement"):
            raise ValueError(f"pool_mode must be session, transaction or statement, not "
                             f"{pool_mode!r}")
        self.upstream = make_url(upstream_url)
        if self.upstream.port is None:
            raise ValueError("upstream_url needs an explicit port")
        self.pool_mode: PoolMode = pool_mode
        self.pool_size = pool_size
        self.settings = dict(settings or {})
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self.dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"LocalPgBouncer(pool_mode={self.pool_mode!r}, port={self.port!r})"

    def url(self, database: str | None = None) -> str:
        """The upstream URL (of ``database``, by default the upstream's) through the pooler."""
        if self.port is None:
            raise DevClusterError("PgBouncer is not started: call start() first")
        url = self.upstream.set(host="127.0.0.1", port=self.port)
        if database is not None:
            url = url.set(database=database)
        return url.render_as_string(hide_password=False)

    def start(self) -> None:
        if self._proc is not None:
            raise DevClusterError("PgBouncer is already started")
        binary = find_pgbouncer()
        user = server_user("PgBouncer")
        self.dir = Path(tempfile.mkdtemp(prefix="dualwrite-pgbouncer-"))
        (self.port,) = free_ports(1)
        username = self.upstream.username or "postgres"
        (self.dir / "userlist.txt").write_text(f'"{username}" ""\n', encoding="utf-8")
        config = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(self.dir / "userlist.txt"),
            "pool_mode": self.pool_mode,
            "default_pool_size": str(self.pool_size),
            "max_client_conn": "500",
            "ignore_startup_parameters": "extra_float_digits,options",
            "logfile": str(self.dir / "pgbouncer.log"),
            "pidfile": str(self.dir / "pgbouncer.pid"),
            "admin_users": username,
            **self.settings,
        }
        lines = ["[databases]",
                 f"* = host={self.upstream.host or '127.0.0.1'} port={self.upstream.port}",
                 "[pgbouncer]", *(f"{k} = {v}" for k, v in config.items())]
        ini = self.dir / "pgbouncer.ini"
        ini.write_text("\n".join(lines) + "\n", encoding="utf-8")
        run_as: dict[str, Any] = {}
        if user is not None:
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, user.pw_uid, user.pw_gid)
            run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        self._proc = subprocess.Popen(
            [str(binary), str(ini)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=parent_death_signal(), **run_as)
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise
        log.info("PgBouncer (%s pooling) ready on 127.0.0.1:%d", self.pool_mode, self.port)

    def stop(self) -> None:
        """SIGTERM (SIGKILL if it hangs), then remove its folder."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        self.port = None

    def log_text(self) -> str:
        """The end of PgBouncer's log."""
        return tail(self.dir / "pgbouncer.log") if self.dir is not None else ""

    def _wait_until_ready(self) -> None:
        import psycopg

        dsn = (f"host=127.0.0.1 port={self.port} dbname={self.upstream.database or 'postgres'} "
               f"user={self.upstream.username or 'postgres'} connect_timeout=2")
        deadline = time.monotonic() + self.startup_timeout
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise DevClusterError(f"pgbouncer exited with code {self._proc.returncode} "
                                      f"during startup:\n{self.log_text()}")
            with contextlib.suppress(psycopg.OperationalError):
                with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
                    conn.execute("SELECT 1")
                return
            if time.monotonic() > deadline:
                raise DevClusterError(f"PgBouncer did not accept connections within "
                                      f"{self.startup_timeout} s:\n{self.log_text()}")
            time.sleep(0.1)
