"""Resolve the jars of an Apache Kafka broker with Maven, and cache the resulting classpath.

Jars live in the Maven local repository (``~/.m2`` by default), so a second resolution is
offline and fast; the classpath itself is cached under ``$DUALWRITE_HOME/classpath``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path

from dualwrite.dev._util import DevClusterError, dualwrite_home

__all__ = ["POM_RESOURCE", "kafka_classpath", "logging_flavour", "major_version",
           "resolve_classpath"]

log = logging.getLogger(__name__)

POM_RESOURCE = "kafka-runtime.pom.xml"
MAVEN_TIMEOUT_S = 900.0


def major_version(kafka_version: str) -> int:
    """The major number of a Kafka version string such as ``"4.3.1"``."""
    try:
        return int(kafka_version.split(".", 1)[0])
    except ValueError:
        raise DevClusterError(
            f"cannot parse Kafka version {kafka_version!r}: expected e.g. '4.3.1' or '3.9.1'"
        ) from None


def logging_flavour(kafka_version: str) -> str:
    """Which SLF4J binding the broker needs: ``log4j2`` for Kafka 4.x, ``reload4j`` for 3.x."""
    return "log4j2" if major_version(kafka_version) >= 4 else "reload4j"


def _find_mvn(product: str) -> str:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise DevClusterError(
            f"mvn not found on PATH: install Apache Maven 3.8+ (e.g. `apt-get install maven`) "
            f"to download the {product} jars, or use the Docker backend where a Docker engine runs"
        )
    return mvn


def resolve_classpath(product: str, version: str, pom_resource: str,
                      properties: dict[str, str], *, coordinates: str,
                      maven_repo_local: Path | None = None, refresh: bool = False) -> list[Path]:
    """The jars ``pom_resource`` (a pom of this package) resolves with ``properties``.

    Maven's local repository (``maven_repo_local``, env ``DUALWRITE_MAVEN_REPO_LOCAL``, or
    ``~/.m2/repository``) holds the jars; ``$DUALWRITE_HOME/classpath`` caches the resolved
    classpath, keyed by the pom, the properties and the repository. ``coordinates`` names the
    artifact in the error Maven's failure raises.
    """
    if maven_repo_local is None and os.environ.get("DUALWRITE_MAVEN_REPO_LOCAL"):
        maven_repo_local = Path(os.environ["DUALWRITE_MAVEN_REPO_LOCAL"])
    pom = (resources.files("dualwrite.dev") / pom_resource).read_text(encoding="utf-8")
    key = hashlib.sha256("\0".join(
        [pom, *properties.values(), str(maven_repo_local or "")]).encode()).hexdigest()[:12]
    cache_dir = dualwrite_home() / "classpath"
    cache_file = cache_dir / f"{product.lower()}-{version}-{key}.txt"
    if not refresh and cache_file.exists():
        jars = [Path(p) for p in cache_file.read_text().strip().split(os.pathsep) if p]
        if jars and all(j.is_file() for j in jars):
            return jars
        log.info("cached classpath %s points at missing jars; resolving again", cache_file)

    mvn = _find_mvn(product)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dualwrite-mvn-") as tmp:
        pom_path = Path(tmp) / "pom.xml"
        pom_path.write_text(pom, encoding="utf-8")
        out = Path(tmp) / "classpath.txt"
        cmd = [mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(pom_path),
               "dependency:build-classpath", *(f"-D{k}={v}" for k, v in properties.items()),
               f"-Dmdep.outputFile={out}"]
        if maven_repo_local is not None:
            cmd.append(f"-Dmaven.repo.local={maven_repo_local}")
        log.info("resolving %s %s jars with Maven (the first time can take a minute)", product,
                 version)
        started = time.monotonic()
        try:
            result = subprocess.run(
                cmd, capture_output=True, text=True, timeout=MAVEN_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            raise DevClusterError(
                f"Maven did not resolve {product} {version} within {MAVEN_TIMEOUT_S:.0f} s; "
                "check that Maven Central (or your mirror in ~/.m2/settings.xml) is reachable"
            ) from None
        if result.returncode != 0 or not out.exists():
            text = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)
            output = "\n".join(text.strip().splitlines()[-25:])
            raise DevClusterError(
                f"Maven could not resolve {coordinates}. Check that the version exists on Maven "
                "Central and that Central (or your mirror) is reachable. Maven said:\n"
                f"{output}"
            )
        classpath = out.read_text().strip()
        log.info("resolved %s %s jars in %.1f s", product, version, time.monotonic() - started)
    tmp_cache = cache_file.with_suffix(f".{os.getpid()}.tmp")
    tmp_cache.write_text(classpath)
    tmp_cache.replace(cache_file)
    return [Path(p) for p in classpath.split(os.pathsep) if p]


def kafka_classpath(
    kafka_version: str,
    *,
    maven_repo_local: Path | None = None,
    refresh: bool = False,
) -> list[Path]:
    """The jar files needed to run a ``kafka_version`` broker, downloading them if needed.

    ``maven_repo_local`` (or env ``DUALWRITE_MAVEN_REPO_LOCAL``) replaces ``~/.m2/repository``.
    """
    return resolve_classpath(
        "Kafka", kafka_version, POM_RESOURCE,
        {"kafka.version": kafka_version, "kafka.logging": logging_flavour(kafka_version)},
        coordinates=f"org.apache.kafka:kafka_2.13:{kafka_version}",
        maven_repo_local=maven_repo_local, refresh=refresh)
