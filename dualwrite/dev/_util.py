"""Small helpers shared by the local Kafka and PostgreSQL launchers."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, cast

__all__ = [
    "DevClusterError",
    "LocalServer",
    "choose_backend",
    "docker_available",
    "dualwrite_home",
    "free_ports",
    "parent_death_signal",
    "pid_alive",
    "port_open",
    "read_state",
    "server_user",
    "tail",
    "terminate_pid",
    "write_state",
]

_PR_SET_PDEATHSIG = 1

_Local = TypeVar("_Local", Literal["jars"], Literal["binaries"])


class DevClusterError(RuntimeError):
    """A local development server could not be started, found or stopped."""


def find_java(needed_by: str) -> str:
    """The ``java`` of ``JAVA_HOME``, else of ``PATH``."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    java = shutil.which("java")
    if java is None:
        raise DevClusterError(
            "java not found: install OpenJDK 17 (e.g. `apt-get install openjdk-17-jre-headless`) "
            f"or set JAVA_HOME; {needed_by} need Java 17 or newer"
        )
    return java


def dualwrite_home() -> Path:
    """The folder for caches and state: ``$DUALWRITE_HOME`` or ``./.dualwrite`` (git-ignored)."""
    env = os.environ.get("DUALWRITE_HOME")
    return Path(env).expanduser().resolve() if env else Path.cwd() / ".dualwrite"


@contextlib.contextmanager
def _reserved_sockets(count: int) -> Iterator[list[socket.socket]]:
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        yield sockets
    finally:
        for s in sockets:
            s.close()


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago (all bound at once)."""
    with _reserved_sockets(count) as sockets:
        return [int(s.getsockname()[1]) for s in sockets]


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a text file, or a note that it does not exist."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return f"(no log file at {path})"
    return "\n".join(text.splitlines()[-lines:])


def parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when this process dies (Linux only).

    Keeps a crashed test run from leaving servers behind. Linux ties the signal to the
    creating *thread*, so it is only used when called from the main thread.
    """
    if os.uname().sysname != "Linux":
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def _set() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return _set


def server_user(program: str, account: str = "postgres") -> pwd.struct_passwd | None:
    """The account to run a server as: None (ourselves) unless we are root, which PostgreSQL,
    PgBouncer and MariaDB refuse; then ``account`` (or ``nobody``)."""
    if os.geteuid() != 0:
        return None
    for name in (account, "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise DevClusterError(
        f"running as root, and neither a '{account}' nor a 'nobody' user exists; {program} "
        f"refuses to run as root: create a '{account}' user or run as a normal user"
    )


def write_state(path: Path, state: Mapping[str, Any]) -> None:
    """Write a detached server's state as JSON to ``path`` (atomically: a reader never sees
    half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def read_state(path: Path) -> dict[str, Any]:
    """The state :func:`write_state` wrote to ``path``."""
    return cast(dict[str, Any], json.loads(path.read_text(encoding="utf-8")))


def pid_alive(pid: int, must_contain: str | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, if given, its command line contains a marker.

    The marker guards against a recycled pid belonging to an unrelated process.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    proc = Path(f"/proc/{pid}")
    if proc.exists():
        try:
            stat = (proc / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                return False
            if must_contain is not None:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
                return must_contain in cmdline.decode(errors="replace")
        except OSError:
            return False
    return True


def terminate_pid(
    pid: int,
    timeout: float,
    must_contain: str | None = None,
    sig: signal.Signals = signal.SIGTERM,
) -> bool:
    """Send ``sig``, wait up to ``timeout`` seconds, then SIGKILL. True if it had to be killed."""
    if not pid_alive(pid, must_contain):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(pid)
        if not pid_alive(pid):
            return False
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        _reap(pid)
        if not pid_alive(pid):
            break
        time.sleep(0.05)
    return True


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


_docker_ok: bool | None = None


def docker_available() -> bool:
    """Whether a Docker engine answers (``docker info`` succeeds); cached per process."""
    global _docker_ok
    if _docker_ok is None:
        if shutil.which("docker") is None:
            _docker_ok = False
        else:
            try:
                result = subprocess.run(
                    ["docker", "info", "--format", "{{.ServerVersion}}"],
                    capture_output=True,
                    timeout=10,
                    check=False,
                )
                _docker_ok = result.returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                _docker_ok = False
    return _docker_ok


def choose_backend(requested: str, local: _Local, local_hint: str) -> _Local | Literal["docker"]:
    """The backend to run: ``requested`` if given ("docker" only where an engine answers), else
    Docker where available and ``local`` (the jars or binaries on this machine) elsewhere."""
    if requested == "docker":
        if not docker_available():
            raise DevClusterError("backend='docker' but no Docker engine answers `docker info`; "
                                  f"start Docker or {local_hint}")
        return "docker"
    if requested == local:
        return local
    return "docker" if docker_available() else local


class LocalServer:
    """A server started and stopped by this process; as a context manager, it runs for the
    ``with`` block."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
