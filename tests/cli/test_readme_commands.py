"""Every command and Python block the README files show runs, in a quick form, and says it worked.

The blocks are read from the documents themselves: a shell or Python block that no scenario
below covers fails ``test_every_readme_block_is_covered``, so a command added to a README is
tested without anyone remembering to. A scenario runs its block(s) as written, with only the
edits it lists (fewer batches, this run's servers instead of example addresses); each edit must
still match its block, so a changed command cannot silently fall out of the test. Each scenario
checks its own success line (``verified: lost=0 duplicates=0 open=0`` for the demos), not only the
exit code.

The commands run in a scratch folder that links the repository's files, with ``.venv`` pointing
at the interpreter running the tests, ``DUALWRITE_SKIP_INSTALL=1`` (CI installed it already), and
the session's Kafka and a fresh PostgreSQL schema in ``DUALWRITE_BOOTSTRAP_SERVERS`` and
``DUALWRITE_DATABASE_URL``. ``dualwrite dev up`` starts one dev cluster for the whole module
(the next ``dev up`` reuses it), in its own ``DUALWRITE_HOME``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dualwrite.dev import KafkaTarget, docker_available, dualwrite_home
from tests.support import REPO_ROOT
from tests.support.db import fresh_schema

DOCUMENTS = ("README.md", "examples/README.md", "spark/README.md", "bench/README.md",
             "docs/operating.md", "docs/writing.md", "docs/compatibility.md")
SHELL = {"", "bash", "sh", "shell", "console"}
VERIFIED = "verified: lost=0 duplicates=0 open=0"

pytestmark = [pytest.mark.timeout(900)]


@dataclass(frozen=True)
class Block:
    document: str
    language: str
    text: str
    line: int

    def __str__(self) -> str:
        return f"{self.document}:{self.line} ({self.language or 'plain'})"


def code_blocks(document: str) -> list[Block]:
    """The fenced code blocks of ``document`` (a path relative to the repository)."""
    blocks: list[Block] = []
    language: str | None = None
    start = 0
    lines: list[str] = []
    for number, line in enumerate((REPO_ROOT / document).read_text().splitlines(), 1):
        if line.startswith("```"):
            if language is None:
                language, start, lines = line[3:].strip(), number, []
            else:
                blocks.append(Block(document, language, "\n".join(lines) + "\n", start))
                language = None
        elif language is not None:
            lines.append(line)
    return blocks


def runnable_blocks() -> list[Block]:
    return [b for d in DOCUMENTS for b in code_blocks(d) if b.language in SHELL | {"python"}]


@dataclass(frozen=True)
class Scenario:
    """How the test runs one or more README blocks.

    ``blocks``: a distinctive line of each block it covers (in the order they run). ``edits``:
    (old, new) replacements, each of which must match. ``expect``: regular expressions and how
    often each must at least appear in the output. Python blocks run in one interpreter after
    ``setup`` and before ``check``; shell ``before`` and ``after`` wrap the whole script.
    """

    name: str
    blocks: tuple[str, ...]
    expect: tuple[tuple[str, int], ...]
    edits: tuple[tuple[str, str], ...] = ()
    setup: str = ""
    check: str = ""
    before: str = ""
    after: str = ""


DEMO_QUICK = "--batches 3 --crash-batch 1 --rows-per-batch 200"

USING_IT_CHECK = """
with engine.connect() as conn:
    counts = [conn.execute(sa.select(sa.func.count()).select_from(t)).scalar()
              for t in (orders, shipments)]
print(f"orders and shipments: {counts[0]} {counts[1]}")
"""

HTTP_SERVICE_CHECK = """
wait %2                                  # the load generator, through the restart
DB="$DB" "$VENV_PYTHON" - <<'EOF'
import collections, os
import sqlalchemy as sa
import dualwrite as dw
from dualwrite.dev import read_committed
acked = set(open("acked.txt").read().split())
with dw.create_engine(os.environ["DB"]).connect() as conn:
    rows = {r[0] for r in conn.execute(sa.text("SELECT order_id FROM http_orders"))}
records, unfinished = read_committed(os.environ["DUALWRITE_BOOTSTRAP_SERVERS"], "orders",
                                     timeout_s=60)
events = collections.Counter(k.decode() for k, _ in records if k.startswith(b"o-"))
assert not unfinished and acked and acked <= rows and set(events) == rows, (
    len(acked - rows), len(rows ^ set(events)), unfinished)
assert max(events.values()) == 1, events.most_common(3)
print(f"http service: {len(acked)} acknowledged, {len(rows)} rows == events, each once")
EOF
kill %3
"""

PIPELINE_ROWS = """
"$VENV_PYTHON" - <<'EOF'
import os
import sqlalchemy as sa
import dualwrite as dw
# The PostgreSQL the commands used: spark/README's `dev up` exports the dev cluster's when it
# runs one (the using-it scenario started it with --postgres), else the scenario's stays.
for name, db in (("sqlite", "sqlite:///dualwrite-demo.db"),
                 ("postgresql", os.environ["DUALWRITE_DATABASE_URL"])):
    with dw.create_engine(db).connect() as conn:
        print("rows", name,
              conn.execute(sa.text("SELECT count(*) FROM orders_enriched")).scalar())
EOF
"""

ORDER_SERVICE_CHECK = """
"$VENV_PYTHON" - <<'EOF'
import os
import sqlalchemy as sa
from dualwrite.dev import read_committed
engine = sa.create_engine("sqlite:///orders.db")
with engine.connect() as conn:
    rows = sorted(str(r[0]) for r in conn.execute(sa.text("SELECT order_id FROM service_orders")))
records, unfinished = read_committed(os.environ["DUALWRITE_BOOTSTRAP_SERVERS"], "orders",
                                     timeout_s=30)
keys = sorted(k.decode() for k, _ in records if k.startswith(b"order-"))
print(f"orders: {len(rows)} rows, {len(keys)} records, equal={rows == keys}, open={unfinished}")
EOF
"""

# `recover --watch` in the background until its first pass, one scrape of its /metrics, SIGTERM.
WATCH = (
    """PORT=$("$VENV_PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); """
    """print(s.getsockname()[1])"); """
    """.venv/bin/dualwrite recover --watch 1 --metrics-port "$PORT" > watch.log 2>&1 & pid=$!; """
    """for _ in $(seq 300); do grep -q "pass 1: ok" watch.log && break; sleep 0.2; done; """
    """"$VENV_PYTHON" -c "import sys, urllib.request; """
    """print(urllib.request.urlopen(sys.argv[1]).read().decode())" """
    """"http://127.0.0.1:$PORT/metrics" | grep "^dualwrite_recovery_passes_total"; """
    """kill -TERM $pid; wait $pid; cat watch.log""")

SCENARIOS = [
    Scenario(
        "developing",
        ("./run.sh test         #",),
        # .ci/run is these two commands (test_ci_runs_the_readme_test_command).
        # tests/soak/test_soak.py runs the soak's quick form (three minutes) through run.sh.
        edits=(("./run.sh test         #", ": ./run.sh test         #"),
               ("./run.sh test -m unit #", ": ./run.sh test -m unit #"),
               ("./run.sh lint         #", ": ./run.sh lint         #"),
               ("./run.sh soak         #", ": ./run.sh soak         #")),
        expect=(),
    ),
    Scenario(
        "using-it",
        ("./run.sh demo-orders  #", "import dualwrite as dw\n", "pool = dw.DualWriterPool(",
         "apool = dw.AsyncDualWriterPool(", "from dualwrite.spark import ExactlyOnceSink",
         "consumer = dw.ExactlyOnceConsumer(", "dualwrite verify --table orders"),
        edits=(("./run.sh demo-orders  #", "./run.sh demo-orders --orders 6 #"),),
        check=USING_IT_CHECK,
        # The demo's verification and the two `dualwrite verify` runs; `status` exits 0.
        expect=((re.escape(VERIFIED), 3), ("^True$", 1), (r"^in doubt: 0", 1),
                (r"^orders and shipments: (\d{2,}) \1$", 1)),
    ),
    Scenario(
        "orders-pipeline",
        ("--max-batches 10\n", "# --source kafka additionally needs:"),
        edits=(("--max-batches 10", "--max-batches 2 --rows-per-batch 200"),
               ("--master 'local[4]'", "--master 'local[2]'"),
               ("-b 127.0.0.1:9092 --db postgresql://app@db/shop",
                '-b "$DUALWRITE_BOOTSTRAP_SERVERS" --db "$DUALWRITE_DATABASE_URL" '
                "--max-batches 2 --rows-per-batch 200")),
        after=PIPELINE_ROWS,
        expect=((r"orders pipeline stopped: 2 batches", 2), (r"^rows sqlite 400$", 1),
                (r"^rows postgresql 400$", 1)),
    ),
    Scenario(
        "docker-env",
        ("export DUALWRITE_DATABASE_URL=postgresql+psycopg://dualwrite:dualwrite@127.0.0.1:5432",),
        # Where no Docker engine answers, the block's exports point at this run's servers.
        edits=(("export DUALWRITE_BOOTSTRAP_SERVERS=127.0.0.1:9092",
                "export DUALWRITE_BOOTSTRAP_SERVERS=$SCENARIO_BOOTSTRAP"),
               ("export DUALWRITE_DATABASE_URL=postgresql+psycopg://dualwrite:dualwrite@"
                "127.0.0.1:5432/dualwrite", "export DUALWRITE_DATABASE_URL=$SCENARIO_DATABASE_URL"
                "\n.venv/bin/dualwrite db upgrade\n.venv/bin/dualwrite status"),
               ('./run.sh demo --db "$DUALWRITE_DATABASE_URL"',
                f'./run.sh demo {DEMO_QUICK} --db "$DUALWRITE_DATABASE_URL"'),
               ("DUALWRITE_TEST_BOOTSTRAP=127.0.0.1:9092 ./run.sh test",
                ": the test suite with the cluster of docker compose: .ci/run runs it")),
        expect=((r"is at revision \w+", 1), (r"^in doubt: 0", 1), (re.escape(VERIFIED), 1)),
    ),
    Scenario(
        "order-service",
        ('examples/order_service.py --db sqlite:///orders.db -b "$DUALWRITE_BOOTSTRAP_SERVERS" '
         "--orders 10", "--crash-at after-db-commit --crash-on 12"),
        edits=(("--crash-on 12      # exits with -9", "--crash-on 12 || [ $? -eq 137 ]"),
               # status exits 5 while something is in doubt, as it is here.
               (".venv/bin/dualwrite status  --db sqlite:///orders.db                    #",
                ".venv/bin/dualwrite status  --db sqlite:///orders.db || [ $? -eq 5 ] #")),
        after=ORDER_SERVICE_CHECK,
        expect=((r"^orders: 13 rows, 13 records, equal=True, open=\[\]$", 1),
                (r"^order-service-1 +in-doubt", 1), (r"committed", 1)),
    ),
    Scenario(
        "http-service",
        ("examples/http_service.py --db $DB", "kill -9 %1"),
        edits=(("--seconds 10", "--seconds 5"), ("--seconds 20", "--seconds 10"),
               (".venv/bin/dualwrite status --db $DB        #",
                ".venv/bin/dualwrite status --db $DB || [ $? -eq 5 ] #")),
        after=HTTP_SERVICE_CHECK,
        expect=((r"^[1-9]\d* orders acknowledged", 2),
                (r"^http service: \d+ acknowledged, \d+ rows == events, each once$", 1)),
    ),
    Scenario(
        "bench",
        ("./run.sh bench [--iterations 200]", "./run.sh bench consumer [--messages",
         "./run.sh bench service [--quick]", "./run.sh bench spark [--quick]"),
        edits=(("./run.sh bench [--iterations 200] [--sizes 1,1000] [--recover-ids 1000] "
                "[--pause-ms 10] [--db URL]",
                './run.sh bench --iterations 8 --sizes 1 --recover-ids 5 '
                '--db "$DUALWRITE_DATABASE_URL"'),
               ("./run.sh bench consumer [--messages 20000] [--batch 500] [--rounds 3] "
                "[--db URL]",
                "./run.sh bench consumer --messages 300 --batch 50 --rounds 1 "
                '--db "$DUALWRITE_DATABASE_URL"'),
               ("./run.sh bench service [--quick] [--seconds 5] [--clients 1,8,32,128] "
                "[--size 16]\n                       "
                "[--cases naive,outbox,pool,pool-gc,async-gc,pool-run,async-run]\n"
                "                       [--db URL] [--durable] [--profile]",
                "./run.sh bench service --quick --seconds 0.5 --clients 1,8 --size 4 --pause 0.2 "
                '--db "$DUALWRITE_DATABASE_URL"'),
               ("./run.sh bench spark [--quick] [--records 1000000] [--batches 5] "
                "[--partitions 8]\n                     [--value-bytes 200] [--db postgres|sqlite]"
                " [--db-url URL]\n                     [--tiny-batches 20]\n                     "
                "[--cases baseline,naive+sql,naive+copy,floor,copy,kafka,kafka+sql,"
                "kafka+staged]\n"
                "                     [--json]",
                './run.sh bench spark --quick --records 4000 --batches 2 --tiny-batches 1 '
                '--partitions 2 --cases baseline,floor,copy,kafka,kafka+sql '
                '--db-url "$DUALWRITE_DATABASE_URL"')),
        expect=((r"recover\(\) over 5 in-doubt transactional ids", 1),
                (r"^ +8 async-gc ", 1), (r"^memory per pooled writer", 1),
                (r"^SUMMARY: .*bound [\d,]+/s \([\d.]+x\).*verified OK", 1),
                (r"^SUMMARY: exactly-once / at-least-once = [\d.]+x", 1)),
    ),
    Scenario(
        "payments-consumer",
        ("dualwrite dev up --topic payments --topic order-paid",),
        edits=(("--crash-after-db-commit 2      # exits with -9",
                "--crash-after-db-commit 2 || [ $? -eq 137 ]"),
               ("status --db sqlite:///payments.db   #",
                "status --db sqlite:///payments.db || [ $? -eq 5 ] #")),
        expect=((r"^fed 200 orders and their payments$", 1),
                (r"^killed after the database committed batch 2$", 1),
                (r"dualwrite-consumer-payments-consumer-0 +in-doubt", 1),
                (r"^\d+ payments consumed as dualwrite-consumer-payments-consumer-0", 1),
                (re.escape(VERIFIED), 1)),
    ),
    Scenario(
        "bench-commit",
        ("./run.sh bench commit [--participants 8,32]",),
        edits=(("./run.sh bench commit [--participants 8,32] [--batches 15] "
                "[--paths threads,pipelined]\n                      [--db-url URL] [--json]",
                './run.sh bench commit --participants 2 --batches 1 '
                '--db-url "$DUALWRITE_DATABASE_URL"'),),
        expect=((r"^pipelined@2 ", 1), (r"^SUMMARY: 8 of 8 records committed once, verified OK",
                                        1)),
    ),
    # Last: its `dev down` stops the module's dev cluster.
    Scenario(
        "cli-verbs",
        ("dualwrite recover --db URL -b HOST:PORT",),
        before="""
eval "$(.venv/bin/dualwrite dev up --topic cli-verbs | grep '^export')"
export DUALWRITE_DATABASE_URL="$SCENARIO_DATABASE_URL"
""",
        edits=(
            ("dualwrite recover --db URL -b HOST:PORT [-t ID ...] [-s SINK ...] [--json]",
             '.venv/bin/dualwrite db upgrade --db "$DUALWRITE_DATABASE_URL" && '
             '"$VENV_PYTHON" -c "$ONE_TRANSACTION" && '
             '.venv/bin/dualwrite recover --db "$DUALWRITE_DATABASE_URL" '
             '-b "$DUALWRITE_BOOTSTRAP_SERVERS" -t readme-verbs --json'),
            ("dualwrite status  --db URL -b HOST:PORT [--json]",
             '.venv/bin/dualwrite status --db "$DUALWRITE_DATABASE_URL" '
             '-b "$DUALWRITE_BOOTSTRAP_SERVERS" --json >/dev/null && echo status-ok'),
            ("dualwrite recover --watch 30 --db URL -b HOST:PORT [--metrics-port 9464]", WATCH),
            ("dualwrite status  --db URL -b HOST:PORT --prometheus",
             '.venv/bin/dualwrite status --db "$DUALWRITE_DATABASE_URL" '
             '-b "$DUALWRITE_BOOTSTRAP_SERVERS" --prometheus | grep "^dualwrite_in_doubt "'),
            ("dualwrite verify  --db URL -b HOST:PORT --table T --key COLUMN --topic TOPIC "
             "[--json]",
             '"$VENV_PYTHON" -c "$ONE_ROW" && .venv/bin/dualwrite verify '
             '--db "$DUALWRITE_DATABASE_URL" -b "$DUALWRITE_BOOTSTRAP_SERVERS" '
             "--table verbs --key k --topic cli-verbs --json"),
            ("dualwrite force-terminate -b HOST:PORT -t ID [--force]",
             '.venv/bin/dualwrite force-terminate -b "$DUALWRITE_BOOTSTRAP_SERVERS" '
             "-t readme-verbs --yes"),
            ("dualwrite db upgrade --db URL",
             '.venv/bin/dualwrite db upgrade --db "$DUALWRITE_DATABASE_URL"'),
            ("dualwrite probe -b HOST:PORT [--json]",
             '.venv/bin/dualwrite probe -b "$DUALWRITE_BOOTSTRAP_SERVERS" --no-2pc-check'),
            ("dualwrite -v ...",
             '.venv/bin/dualwrite -v status -b "$DUALWRITE_BOOTSTRAP_SERVERS" '
             '--db "$DUALWRITE_DATABASE_URL" >/dev/null'),
            ("dualwrite dev up [--brokers 1|3] [--kafka-version V] [--security sasl] "
             "[--postgres|--mariadb] [--topic NAME]",
             ".venv/bin/dualwrite dev up --topic cli-verbs"),
            ("dualwrite dev create-topic NAME [--partitions N] | dev status | dev down",
             ".venv/bin/dualwrite dev create-topic cli-verbs-2 --partitions 2 && "
             ".venv/bin/dualwrite dev status && .venv/bin/dualwrite dev down && "
             "! .venv/bin/dualwrite dev status"),
        ),
        expect=((r'"transactional_id": "readme-verbs"', 1), (r"^status-ok$", 1),
                (r"is at revision \w+", 2), (r"^dualwrite: supported", 1),
                (r"^created topic cli-verbs-2", 1), (r"^stopped the dev cluster", 1),
                (r"is already running at", 1),
                (r'^dualwrite_recovery_passes_total\{result="ok"\} [1-9]', 1),
                (r"pass 1: ok in .*; in doubt 0", 1), (r"stopped \(signal\)$", 1),
                (r"^dualwrite_in_doubt 0\.0$", 1), (r'"ok": true', 1)),
    ),
]


def _scenario_blocks(scenario: Scenario) -> list[Block]:
    found = []
    for marker in scenario.blocks:
        matches = [b for b in runnable_blocks() if marker in b.text]
        assert matches, f"{scenario.name}: no README block contains {marker!r} any more"
        found.append(matches[0])
    return found


@pytest.mark.unit
def test_every_readme_block_is_covered() -> None:
    covered = {str(b) for s in SCENARIOS for b in _scenario_blocks(s)}
    missing = [str(b) for b in runnable_blocks() if str(b) not in covered]
    assert not missing, f"README blocks no scenario runs (add one to SCENARIOS): {missing}"


@pytest.mark.unit
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario_edits_still_match(scenario: Scenario) -> None:
    text = "".join(b.text for b in _scenario_blocks(scenario))
    stale = [old for old, _ in scenario.edits if old not in text]
    assert not stale, f"{scenario.name}: the README no longer shows {stale}; update the scenario"


@pytest.mark.unit
def test_ci_runs_the_readme_test_command() -> None:
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "./run.sh test" in ci and "./run.sh lint" in ci


# -- running them ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A scratch folder that looks like the repository to the commands; its own DUALWRITE_HOME
    (with the resolved Kafka classpath and Spark's Kafka connector copied: no Maven runs)."""
    work = tmp_path_factory.mktemp("readme")
    for entry in REPO_ROOT.iterdir():
        if entry.name not in {".venv", ".git", ".dualwrite"} and not entry.name.endswith(".db"):
            (work / entry.name).symlink_to(entry)
    (work / ".venv").symlink_to(Path(sys.prefix))
    for resolved in ("classpath", "spark-kafka-jars"):
        if (dualwrite_home() / resolved).is_dir():
            shutil.copytree(dualwrite_home() / resolved, work / ".dualwrite" / resolved)
    yield work
    subprocess.run([str(Path(sys.prefix) / "bin" / "dualwrite"), "dev", "down"], cwd=work,
                   env=_base_env(work), capture_output=True, timeout=120, check=False)


def _base_env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DUALWRITE_", "PYSPARK_", "SPARK_"))}
    env.update(DUALWRITE_HOME=str(work / ".dualwrite"), DUALWRITE_SKIP_INSTALL="1",
               SPARK_LOCAL_IP="127.0.0.1", VENV_PYTHON=str(Path(sys.prefix) / "bin" / "python"),
               PYTHONUNBUFFERED="1")
    return env


@pytest.fixture
def fresh_database_url(postgres_url: str) -> Iterator[str]:
    with fresh_schema(postgres_url, "readme") as url:
        yield url


ONE_TRANSACTION = """
import os, dualwrite as dw
with dw.DualWriter(os.environ["DUALWRITE_DATABASE_URL"],
                   {"bootstrap.servers": os.environ["DUALWRITE_BOOTSTRAP_SERVERS"]},
                   transactional_id="readme-verbs") as w, w.transaction() as tx:
    tx.produce("cli-verbs", b"v", key=b"k")
"""


ONE_ROW = """
import os, sqlalchemy as sa
with sa.create_engine(os.environ["DUALWRITE_DATABASE_URL"]).begin() as conn:
    conn.execute(sa.text("CREATE TABLE verbs (k TEXT PRIMARY KEY)"))
    conn.execute(sa.text("INSERT INTO verbs VALUES ('k')"))
"""


def _script(scenario: Scenario, work: Path) -> str:
    """The scenario's blocks as one bash script, in the README's order. Consecutive Python
    blocks run in one interpreter (the venv's python), ``setup`` before the first of them and
    ``check`` after the last, so a shell block after them sees what they did."""
    parts = ["set -euo pipefail", scenario.before]
    chunks: list[list[str]] = []  # runs of consecutive Python blocks
    python: list[str] = []
    seen: dict[str, str] = {}  # command -> the document that showed it

    def run_python() -> None:
        if python:
            chunks.append(list(python))
            parts.append(f"__PYTHON_{len(chunks) - 1}__")
            python.clear()

    for block in _scenario_blocks(scenario):
        text = block.text
        for old, new in scenario.edits:
            text = text.replace(old, new)
        if block.language == "python":
            python.append(text)
            continue
        run_python()
        for line in re.sub(r"\\\n\s*", " ", text).splitlines():
            command = line.split(" #")[0].strip()
            if command and not command.startswith("#") and seen.get(command, block.document) \
                    != block.document:
                continue  # the same command in two READMEs runs once
            seen.setdefault(command, block.document)
            parts.append(line)
    run_python()
    script = "\n".join([*parts, scenario.after])
    for number, chunk in enumerate(chunks):
        source = "\n".join([scenario.setup if number == 0 else "", *chunk,
                            scenario.check if number == len(chunks) - 1 else ""])
        path = work / f"{scenario.name}-{number}-{uuid.uuid4().hex[:6]}.py"
        path.write_text(source)
        script = script.replace(f"__PYTHON_{number}__", f'"$VENV_PYTHON" {path.name}')
    return script


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_readme_scenario_runs(scenario: Scenario, workdir: Path, kafka: KafkaTarget,
                              fresh_database_url: str) -> None:
    if scenario.name == "docker-env" and docker_available():
        print("a Docker engine answers, but this scenario runs the block against the test's "
              "own servers: `docker compose up` is exercised by users, not CI")
    elif scenario.name == "docker-env":
        print("no Docker engine: the docker-compose env block runs against the test's servers")
    env = _base_env(workdir)
    env.update(DUALWRITE_BOOTSTRAP_SERVERS=kafka.bootstrap_servers,
               DUALWRITE_DATABASE_URL=fresh_database_url,
               SCENARIO_BOOTSTRAP=kafka.bootstrap_servers,
               SCENARIO_DATABASE_URL=fresh_database_url, ONE_TRANSACTION=ONE_TRANSACTION,
               ONE_ROW=ONE_ROW)
    for leftover in workdir.glob("*.db*"):
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()
    shutil.rmtree(workdir / "checkpoints", ignore_errors=True)
    started = time.monotonic()
    result = subprocess.run(["bash", "-c", _script(scenario, workdir)], cwd=workdir, env=env,
                            capture_output=True, text=True, timeout=840, check=False)
    output = result.stdout + result.stderr
    print(f"{scenario.name}: exit {result.returncode} in {time.monotonic() - started:.1f} s")
    (workdir / f"{scenario.name}.log").write_text(output)
    # What the scenario printed itself (the servers' and Spark's chatter left out).
    said = "\n".join(line for line in result.stdout.splitlines()
                     if not re.match(r"\s|WARN|INFO|\d\d/\d\d/\d\d ", line))
    assert result.returncode == 0, f"{scenario.name} failed:\n{said[-3000:]}\n{output[-4000:]}"
    for pattern, count in scenario.expect:
        seen = len(re.findall(pattern, output, re.MULTILINE))
        assert seen >= count, f"{scenario.name}: expected {pattern!r} {count} times, saw {seen}:" \
                              f"\n{said[-4000:]}"
    # The one traceback by design: Spark planned a batch past --max-batches before the query
    # stopped, and orders_pipeline.py fails that batch (BatchLimitReachedError) so that Spark
    # does not mark it done; Spark logs its stack, once per traceback line of it.
    designed = output.count("BatchLimitReachedError: batch")
    assert output.count("Traceback") <= designed, output[-6000:]
