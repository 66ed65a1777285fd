"""Compile and run ``TxnProbe.java``: Pulsar's own Java client, one transaction step a process."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dualwrite.dev._util import dualwrite_home

SOURCE = Path(__file__).with_name("TxnProbe.java")
_QUIET_LOG4J = """\
status = error
appender.err.type = Console
appender.err.name = ERR
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = %d %p %m (%c{1})%n
rootLogger.level = WARN
rootLogger.appenderRef.err.ref = ERR
"""


@dataclass(frozen=True)
class EndResult:
    """One ``end`` line: the TxnID, the action, and ``None`` or the exception class and message."""

    most: int
    least: int
    action: str
    error_class: str | None
    error_message: str | None


Opened = tuple[subprocess.Popen[str], int, int]
"""An opener process and its TxnID's most and least bits."""


class TxnProbe:
    """The compiled probe (classes cached by source and classpath under ``$DUALWRITE_HOME``)."""

    def __init__(self, classpath: list[Path], service_url: str, token: str | None = None) -> None:
        self.service_url = service_url
        self._env = {**os.environ, "PULSAR_AUTH_TOKEN": token or ""}
        key = hashlib.sha256(SOURCE.read_bytes() + os.pathsep.join(map(str, classpath)).encode())
        self.classes = dualwrite_home() / "pulsar-probe" / key.hexdigest()[:12]
        if not (self.classes / "TxnProbe.class").exists():
            javac = shutil.which("javac")
            if javac is None:
                raise RuntimeError("javac not found: install a JDK 17")
            tmp = self.classes.with_name(self.classes.name + f".{os.getpid()}")
            tmp.mkdir(parents=True, exist_ok=True)
            subprocess.run([javac, "-d", str(tmp), "-cp", os.pathsep.join(map(str, classpath)),
                            str(SOURCE)], check=True, capture_output=True, timeout=120)
            tmp.replace(self.classes)
        log4j = self.classes / "log4j2-quiet.properties"
        log4j.write_text(_QUIET_LOG4J, encoding="utf-8")
        self._cmd = ["java", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC",
                     f"-Dlog4j2.configurationFile={log4j}", "-cp",
                     os.pathsep.join([str(self.classes), *map(str, classpath)]), "TxnProbe"]

    def open(self, specs: list[tuple[int, dict[str, int]]]) -> list[Opened]:
        """Start one process per (timeout_ms, {topic: n}): each opens a transaction, produces
        in it, prints its TxnID and waits. Returns (process, most, least): kill the processes."""
        procs = []
        for timeout_ms, writes in specs:
            args = [a for topic, n in writes.items() for a in (topic, str(n))]
            procs.append(subprocess.Popen(
                [*self._cmd, "open", self.service_url, str(timeout_ms), *args],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=self._env))
        opened = []
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline().split()
            if not line or line[0] != "TXN":
                for p in procs:
                    p.kill()
                raise RuntimeError(f"TxnProbe open failed: {' '.join(line)}")
            opened.append((proc, int(line[1]), int(line[2])))
        return opened

    def end(self, *ops: tuple[int, int, str]) -> list[EndResult]:
        """End transactions by TxnID from one new process, in order: (most, least, action)."""
        args = [str(x) for op in ops for x in op]
        out = self._run("end", *args)
        results = []
        for line in out.splitlines():
            if not line.startswith("END "):
                continue
            _, most, least, action, rest = line.split(" ", 4)
            if rest == "OK":
                results.append(EndResult(int(most), int(least), action, None, None))
            else:
                cls, message, _ = (rest.removeprefix("ERR ") + " | ").split(" | ", 2)
                results.append(EndResult(int(most), int(least), action, cls, message.strip()))
        if len(results) != len(ops):
            raise RuntimeError(f"TxnProbe end printed {len(results)} results:\n{out}")
        return results

    def send(self, topic: str, n: int) -> None:
        """Produce ``n`` messages (``plain0``…) outside any transaction."""
        out = self._run("send", topic, str(n))
        if f"SENT {topic} {n}" not in out:
            raise RuntimeError(f"TxnProbe send printed:\n{out}")

    def read(self, *topics: str, idle_ms: int = 1000) -> dict[str, list[str]]:
        """Consume every topic from the earliest message: the values a consumer is given."""
        out = self._run("read", str(idle_ms), *topics)
        values: dict[str, list[str]] = {}
        for line in out.splitlines():
            if line.startswith("READ "):
                parts = line.split(" ")
                values[parts[1]] = [v for v in (parts[3] if len(parts) > 3 else "").split(",") if v]
        if set(values) != set(topics):
            raise RuntimeError(f"TxnProbe read printed:\n{out}")
        return values

    def _run(self, command: str, *args: str) -> str:
        result = subprocess.run([*self._cmd, command, self.service_url, *args], text=True,
                                capture_output=True, timeout=90, check=False, env=self._env)
        if result.returncode != 0:
            raise RuntimeError(f"TxnProbe {command} exited {result.returncode}:\n{result.stdout}"
                               f"\n{result.stderr[-2000:]}")
        return result.stdout
