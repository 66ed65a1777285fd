#!/usr/bin/env bash
# One entry point for a fresh machine: installs what dualwrite needs, then runs it.
#   ./run.sh demo         Spark pipeline -> orders table + topic exactly once: SIGKILL, restart, verify
#   ./run.sh demo-orders  order service (DualWriter): atomic row + event, crash, recover, verify
#   ./run.sh test         the test suite (real Kafka 4.3.1 and 3.9.x, real PostgreSQL, SQLite)
#   ./run.sh lint         ruff over the repository, mypy --strict over what ships or is documented
#   ./run.sh bench        benchmarks (bench/)
#   ./run.sh soak         every role at once under 200 mixed faults, checked by Kafka's tools
# Extra arguments go to the underlying command (e.g. ./run.sh test -k crash, ./run.sh test --soak,
# ./run.sh test -m unit: only the tests that need no server).
# DUALWRITE_VENV: the virtualenv (default .venv); DUALWRITE_SKIP_INSTALL=1: use it as it is.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DUALWRITE_VENV:-.venv}
# Spark's driver (demo, pipelines, tests) binds to loopback unless told otherwise.
export SPARK_LOCAL_IP=${SPARK_LOCAL_IP:-127.0.0.1}
[ -x /usr/local/go/bin/go ] && export PATH="$PATH:/usr/local/go/bin"

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

install_system_packages() {
    [ -n "${DUALWRITE_SKIP_INSTALL:-}" ] && return 0
    local missing=()
    command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)
    command -v mvn >/dev/null 2>&1 || missing+=(maven)
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
    command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
    # Go (1.26+, preinstalled in /usr/local/go on these machines) builds the kfake test broker.
    command -v go >/dev/null 2>&1 || [ -x /usr/local/go/bin/go ] || missing+=(golang-go)
    command -v mariadbd >/dev/null 2>&1 || [ -x /usr/sbin/mariadbd ] || missing+=(mariadb-server)
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "missing: ${missing[*]} — install them (Java 17, Maven, PostgreSQL server, PgBouncer, MariaDB server) or use Docker" >&2
        exit 1
    fi
    say "installing ${missing[*]} (Debian packages)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

install_python() {
    [ -n "${DUALWRITE_SKIP_INSTALL:-}" ] && return 0
    local stamp="$VENV/.dualwrite-installed"
    if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt constraints.txt ]; then
        return 0
    fi
    say "creating $VENV and installing dualwrite[dev,spark,service,metrics,asyncio,mariadb] (pinned by constraints.txt)"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # setuptools warns on every editable install of a flat layout (a folder named like the
    # package may shadow it: here it is the package); that one warning only.
    PYTHONWARNINGS="ignore:Editable installation" \
        "$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[dev,spark,service,metrics,asyncio,mariadb]"
    touch "$stamp"
}

cmd=${1:-help}
shift || true
case "$cmd" in
    demo)
        install_system_packages; install_python
        exec "$VENV/bin/python" spark/demo.py "$@" ;;
    demo-orders)
        install_system_packages; install_python
        exec "$VENV/bin/python" examples/demo.py "$@" ;;
    test)
        install_system_packages; install_python
        exec "$VENV/bin/python" -m pytest "$@" ;;
    lint)
        install_python
        "$VENV/bin/ruff" check .
        "$VENV/bin/mypy" --strict dualwrite
        # One run per folder: spark/ and examples/ both have a demo.py.
        for scripts in spark bench examples; do "$VENV/bin/mypy" --strict "$scripts"; done
        exec "$VENV/bin/mypy" --strict --explicit-package-bases tests ;;
    soak)
        install_system_packages; install_python
        exec "$VENV/bin/python" -m tests.soak "$@" ;;
    bench)
        install_system_packages; install_python
        if [ "${1:-}" = spark ]; then
            shift
            exec "$VENV/bin/python" bench/bench_spark.py "$@"
        fi
        if [ "${1:-}" = consumer ]; then
            shift
            exec "$VENV/bin/python" bench/bench_consumer.py "$@"
        fi
        if [ "${1:-}" = decision ]; then
            shift
            exec "$VENV/bin/python" bench/bench_decision.py "$@"
        fi
        if [ "${1:-}" = service ]; then
            shift
            exec "$VENV/bin/python" bench/bench_service.py "$@"
        fi
        if [ "${1:-}" = commit ]; then
            shift
            exec "$VENV/bin/python" bench/bench_commit.py "$@"
        fi
        exec "$VENV/bin/python" bench/bench_dual_write.py "$@" ;;
    *)
        sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
        [ "$cmd" = help ] || exit 2 ;;
esac
