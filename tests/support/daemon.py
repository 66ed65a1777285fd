"""The recovery daemon (``dualwrite recover --watch``) as a process of its own, its output and
its /metrics; a writer SIGKILLed after its database COMMIT, leaving its Kafka transaction in
doubt for the daemon to complete."""

from __future__ import annotations

import contextlib
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import IO

import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from tests.support.workers import CRASH_WORKER, worker_env

SECRET = "s3cret-Pa55word"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the daemon's /metrics)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def with_password(url: str) -> str:
    """``url`` with a password (the private server trusts 127.0.0.1: it is never checked)."""
    return sa.make_url(url).set(password=SECRET).render_as_string(hide_password=False)


class Daemon:
    """A `dualwrite recover --watch` process, its output lines and its /metrics."""

    def __init__(self, args: list[str], port: int | None = None) -> None:
        self.port = port
        cmd = [sys.executable, "-m", "dualwrite.cli", "recover", *args]
        if port is not None:
            cmd += ["--metrics-port", str(port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=worker_env())
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))
        self._queue.put("")

    def output(self) -> str:
        return "\n".join(self.lines)

    def scrape(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        """Every sample of /metrics, parsed with prometheus_client's parser."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert SECRET not in text
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def value(self, name: str, **labels: str) -> float:
        try:
            return self.scrape().get((name, frozenset(labels.items())), 0.0)
        except OSError:  # not serving yet
            return 0.0

    def wait_for(self, what: str, condition: Callable[[], bool], timeout_s: float = 90) -> float:
        deadline = time.monotonic() + timeout_s
        started = time.monotonic()
        while not condition():
            assert self.proc.poll() is None, f"the daemon exited:\n{self.output()}"
            assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s:\n" \
                                                f"{self.output()[-4000:]}"
            time.sleep(0.3)
        return time.monotonic() - started

    def stop(self, sig: signal.Signals) -> tuple[int, float]:
        started = time.monotonic()
        self.proc.send_signal(sig)
        code = self.proc.wait(30)
        return code, time.monotonic() - started

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextlib.contextmanager
def daemon(args: list[str], port: int | None = None) -> Iterator[Daemon]:
    d = Daemon(args, port)
    try:
        yield d
    finally:
        d.kill()
        print(d.output())


@contextlib.contextmanager
def paused(d: Daemon) -> Iterator[None]:
    d.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        d.proc.send_signal(signal.SIGCONT)


def crash_after_db_commit(url: str, bootstrap: str, topic: str, tid: str, txn: int) -> None:
    """A writer that dies (SIGKILL) between its database COMMIT and its Kafka commit of its
    transaction ``txn`` (rows and records ``t<txn>-0``, ``t<txn>-1``)."""
    proc = subprocess.Popen([sys.executable, str(CRASH_WORKER), "--db", url,
                             "--bootstrap", bootstrap, "--topic", topic, "--tid", tid,
                             "--rows", "2", "--first-txn", str(txn),
                             "--crash-point", "after-db-commit"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=worker_env())
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert line.strip() == "AT after-db-commit", (line, proc.stderr and proc.stderr.read())
    finally:
        proc.kill()
        proc.wait(10)
