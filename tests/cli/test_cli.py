"""The ``dualwrite`` command, run as a subprocess the way an operator runs it.

Exit codes are part of the interface: 0 resolved, 3 heuristic outcome, 4 unreachable, 5 some ids
unresolved (see ``dualwrite/cli.py``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

import dualwrite
from dualwrite import TwoPhaseProducer
from dualwrite.batch.coordinator import BatchCoordinator
from dualwrite.batch.decision_log import DecisionLog, Participant
from dualwrite.participant import ControlPlane, TxnState
from dualwrite.writer import StateStore
from tests.support.cli import dualwrite_command, dw
from tests.support.kafka import closed_port, prepare_open, read_committed, unique, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def topic(kafka: Any, new_topic: Any) -> str:
    name: str = new_topic(kafka, partitions=2)
    return name


@pytest.fixture
def db(sqlite_url: str) -> str:
    dualwrite.upgrade_database(sqlite_url)
    return sqlite_url


@pytest.fixture
def store(db: str) -> Any:
    engine = dualwrite.create_engine(db)
    yield StateStore(engine)
    engine.dispose()


def test_help_lists_commands() -> None:
    result = dw("--help")
    assert result.returncode == 0, result.stderr
    for command in ("recover", "status", "probe", "db", "force-terminate"):
        assert command in result.stdout
    assert dw("no-such-command").returncode == 2


def test_database_url_from_the_environment(tmp_path: Path) -> None:
    """DUALWRITE_DATABASE_URL is the name (docker-compose.yml and `dev up` export it); the old
    DUALWRITE_DB still works, with a deprecation warning; --db wins over both."""
    url = f"sqlite:///{tmp_path / 'env.db'}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("DUALWRITE_D")}

    def upgrade(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*dualwrite_command(), "db", "upgrade"], capture_output=True,
                              text=True, timeout=60, env={**base, **env}, check=False)

    current = upgrade(DUALWRITE_DATABASE_URL=url)
    assert current.returncode == 0 and "is at revision" in current.stdout, current.stderr
    assert "deprecated" not in current.stderr
    old = upgrade(DUALWRITE_DB=url)
    assert old.returncode == 0 and "is at revision" in old.stdout, old.stderr
    assert "DUALWRITE_DB is deprecated; set DUALWRITE_DATABASE_URL" in old.stderr
    missing = upgrade()
    assert missing.returncode == 2 and "--db" in missing.stderr


def test_db_upgrade_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    result = dw("db", "upgrade", "--db", url)
    assert result.returncode == 0, result.stderr
    assert "revision" in result.stdout
    engine = dualwrite.create_engine(url)
    try:
        dualwrite.check_schema(engine)  # raises if the tables are missing
    finally:
        engine.dispose()
    assert dw("db", "upgrade", "--db", url).returncode == 0  # again: nothing to do


def test_recover_json(db: str, store: StateStore, bootstrap: str, topic: str) -> None:
    tid = unique("cli-rec")
    state = prepare_open(bootstrap, topic, tid, ["r1", "r2"])
    assert store.compare_and_set(tid, "", str(state))
    result = dw("recover", "--db", db, "-b", bootstrap, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["counts"] == {"committed": 1}
    assert report["results"][0]["transactional_id"] == tid
    assert report["results"][0]["state"] == str(state)
    assert read_committed(bootstrap, topic) == [b"r1", b"r2"]
    second = dw("recover", "--db", db, "-b", bootstrap, "--json")
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["counts"] == {"nothing-to-do": 1}
    text = dw("recover", "--db", db, "-b", bootstrap)  # human-readable form
    assert text.returncode == 0 and tid in text.stdout


def test_recover_heuristic_exit_3(db: str, store: StateStore, bootstrap: str,
                                  topic: str) -> None:
    tid = unique("cli-heur")
    state = prepare_open(bootstrap, topic, tid, ["lost"], timeout_ms=2000)
    assert store.compare_and_set(tid, "", str(state))
    with ControlPlane({"bootstrap.servers": bootstrap}, timeout_s=10) as cp:
        wait_for(lambda: (d := cp.describe_transaction(tid)) is not None
                 and d.state is TxnState.COMPLETE_ABORT, 20, interval_s=0.25,
                 what="the broker to abort the timed-out transaction")
    result = dw("recover", "--db", db, "-b", bootstrap)
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "heuristic-abort" in result.stdout and tid in result.stdout
    acked = dw("recover", "--db", db, "-b", bootstrap, "--acknowledge-heuristic", "--json")
    assert acked.returncode == 0, acked.stderr
    assert json.loads(acked.stdout)["counts"] == {"heuristic-acknowledged": 1}


def test_unreachable_broker_exit_4(db: str, store: StateStore) -> None:
    assert store.compare_and_set(unique("cli-down"), "", "")
    closed = f"127.0.0.1:{closed_port()}"
    for args in (("recover", "--db", db), ("probe",)):
        started = time.monotonic()
        result = dw(*args, "-b", closed, "--timeout", "3")
        assert result.returncode == 4, (args, result.stdout, result.stderr)
        assert "error:" in result.stderr and closed in result.stderr
        assert "Traceback" not in result.stderr
        assert "kafka.net" not in result.stderr  # one message, not every reconnect attempt
        assert time.monotonic() - started < 30


def test_status(db: str, store: StateStore, bootstrap: str, topic: str) -> None:
    prefix = unique("cli-stat")
    doubt, hanging = f"{prefix}-doubt", f"{prefix}-hanging"
    state = prepare_open(bootstrap, topic, doubt, ["s"])
    assert store.compare_and_set(doubt, "", str(state))
    prepare_open(bootstrap, topic, hanging, ["h"])
    text = dw("status", "--db", db, "-b", bootstrap, "--prefix", prefix)
    assert text.returncode == 5, text.stderr  # something is in doubt
    assert doubt in text.stdout and "Ongoing" in text.stdout and str(state) in text.stdout
    assert "in doubt: 1" in text.stdout
    assert hanging in text.stdout
    as_json = dw("status", "--db", db, "-b", bootstrap, "--prefix", prefix, "--json")
    assert as_json.returncode == 5, as_json.stderr
    report = json.loads(as_json.stdout)
    row = report["transactional_ids"][0]
    assert row["transactional_id"] == doubt and row["in_doubt"] is True
    assert row["broker"]["state"] == "Ongoing" and row["broker"]["open_for_ms"] >= 0
    assert [h["transactional_id"] for h in report["hanging"]] == [hanging]
    with ControlPlane({"bootstrap.servers": bootstrap}, timeout_s=10) as cp:
        cp.fence(hanging)
        cp.fence(doubt)


def test_force_terminate_aborts_open_transaction(bootstrap: str, topic: str) -> None:
    tid = unique("cli-force")
    prepare_open(bootstrap, topic, tid, ["never1", "never2"])
    assert read_committed(bootstrap, topic) == []
    result = dw("force-terminate", "-b", bootstrap, "-t", tid, "--yes")
    assert result.returncode == 0, result.stderr
    assert "Ongoing" in result.stdout and tid in result.stdout
    with ControlPlane({"bootstrap.servers": bootstrap}, timeout_s=10) as cp:
        wait_for(lambda: (d := cp.describe_transaction(tid)) is not None
                 and not d.state.in_flight, 10, what="the abort to complete")
    # A later transaction on the same partitions commits; the terminated records never show.
    p = TwoPhaseProducer({"bootstrap.servers": bootstrap, "transactional.id": unique("cli-next"),
                          "linger.ms": 0, "transaction.timeout.ms": 60_000}, timeout_s=20)
    try:
        p.init_transactions()
        p.begin_transaction()
        for partition in (0, 1):
            p.produce(topic, b"later", partition=partition)
        p.prepare_transaction()
        p.commit_transaction()
    finally:
        p.close()
    assert read_committed(bootstrap, topic) == [b"later", b"later"]
    # Without --yes and with no one to confirm, nothing happens.
    refused = dw("force-terminate", "-b", bootstrap, "-t", tid)
    assert refused.returncode != 0


def test_probe_json(bootstrap: str) -> None:
    result = dw("probe", "-b", bootstrap, "--json")
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout)
    assert "transaction_version" in probe
    assert isinstance(probe["transaction_version"], int)
    assert probe["brokers"] and probe["brokers"][0]["api_versions"]
    assert probe["max_transaction_timeout_ms"] and probe["max_transaction_timeout_ms"] > 0


def test_malformed_state_row_exit_5(db: str, store: StateStore, bootstrap: str) -> None:
    tid = unique("cli-bad")
    bad = "dw1:not-a-state:x"
    assert store.compare_and_set(tid, "", bad)
    result = dw("recover", "--db", db, "-b", bootstrap, "--json")
    assert result.returncode == 5, (result.stdout, result.stderr)
    report = json.loads(result.stdout)
    assert report["ok"] is False
    [entry] = report["results"]
    assert entry["outcome"] == "failed" and entry["transactional_id"] == tid
    assert repr(bad) in entry["detail"]
    row = store.read(tid)
    assert row is not None and row.prepared_txn_state == bad  # left alone for a human


def _participant(bootstrap: str, coordinator: BatchCoordinator, topic: str, batch: int,
                 partition: int, attempt: int, value: str) -> Participant:
    """A task attempt of a batch sink: prepared, then dropped (its transaction stays open)."""
    tid = coordinator.transactional_id(batch, partition, attempt)
    p = TwoPhaseProducer({"bootstrap.servers": bootstrap, "transactional.id": tid,
                          "linger.ms": 0, "transaction.timeout.ms": 600_000},
                         control_plane=coordinator.control_plane, timeout_s=20)
    try:
        p.init_transactions()
        p.begin_transaction()
        p.produce(topic, value.encode(), partition=partition)
        state = p.prepare_transaction()
    finally:
        p.close()
    return Participant(partition, tid, state, 1)


def test_recover_batch_sink_heuristic_exit_3(db: str, bootstrap: str, topic: str) -> None:
    sink = unique("cli-sink")
    engine = dualwrite.create_engine(db)
    try:
        with BatchCoordinator(sink, engine, {"bootstrap.servers": bootstrap},
                              timeout_s=20) as coord:
            parts = [_participant(bootstrap, coord, topic, 8, p, 0, f"p{p}") for p in (0, 1)]
            assert coord.decide(8, parts)  # the driver decided, then died
            lost = parts[1]
            coord.control_plane.end_transaction(lost.transactional_id, lost.state.producer_id,
                                                lost.state.epoch, commit=False)  # Kafka aborted it
        result = dw("recover", "--db", db, "-b", bootstrap)
        assert result.returncode == 3, (result.stdout, result.stderr)
        assert f"sink {sink} batch 8: heuristic-abort" in result.stdout
        assert repr(sink) in result.stderr and "batch 8" in result.stderr
        assert lost.transactional_id in result.stderr and "Traceback" not in result.stderr
        record = DecisionLog(engine).read(sink)
        assert record is not None and record.in_doubt
        assert read_committed(bootstrap, topic) == [b"p0"]

        acked = dw("recover", "--db", db, "-b", bootstrap, "--acknowledge-heuristic", "--json")
        assert acked.returncode == 0, (acked.stdout, acked.stderr)
        [entry] = json.loads(acked.stdout)["sinks"]
        assert (entry["sink_id"], entry["batch_id"], entry["outcome"]) == (
            sink, 8, "heuristic-acknowledged")
        record = DecisionLog(engine).read(sink)
        assert record is not None and record.completed
        again = dw("recover", "--db", db, "-b", bootstrap)
        assert again.returncode == 0, again.stderr
        assert f"sink {sink} batch 8: nothing-to-do" in again.stdout
    finally:
        engine.dispose()


def test_status_and_recover_batch_sink(db: str, bootstrap: str, topic: str) -> None:
    sink = unique("cli-sink")
    engine = dualwrite.create_engine(db)
    try:
        with BatchCoordinator(sink, engine, {"bootstrap.servers": bootstrap},
                              timeout_s=20) as coord:
            parts = [_participant(bootstrap, coord, topic, 3, p, 0, f"p{p}") for p in (0, 1)]
            loser = _participant(bootstrap, coord, topic, 3, 0, 1, "loser")
            assert coord.decide(3, parts)  # the driver died before committing
        as_json = dw("status", "--db", db, "-b", bootstrap, "--prefix", sink, "--json")
        assert as_json.returncode == 5, as_json.stderr  # the batch is in doubt
        report = json.loads(as_json.stdout)
        [entry] = report["sinks"]
        assert entry["sink_id"] == sink and entry["last_batch_id"] == 3
        assert entry["in_doubt"] is True and entry["decided_age_s"] >= 0
        assert [(p["transactional_id"], p["broker"]["state"], p["open_as_prepared"])
                for p in entry["participants"]] == [
            (p.transactional_id, "Ongoing", True) for p in parts]
        assert [d["transactional_id"] for d in entry["lingering"]] == [loser.transactional_id]
        assert entry["lingering"][0]["state"] == "Ongoing"
        assert report["hanging"] == []  # the loser is attributed to its sink
        text = dw("status", "--db", db, "-b", bootstrap, "--prefix", sink)
        assert text.returncode == 5, text.stderr
        assert f"sink {sink}: batch 3 in doubt" in text.stdout
        assert f"lingering: {loser.transactional_id}" in text.stdout
        assert "batches in doubt: 1" in text.stdout and "hanging: none" in text.stdout

        assert dw("recover", "--db", db, "-b", bootstrap, "--sink", "not a sink id").returncode \
            == 2
        only_ids = dw("recover", "--db", db, "-b", bootstrap, "-t", unique("cli-other"),
                      "--json")
        assert only_ids.returncode == 0 and json.loads(only_ids.stdout)["sinks"] == []
        result = dw("recover", "--db", db, "-b", bootstrap, "--sink", sink, "--json")
        assert result.returncode == 0, (result.stdout, result.stderr)
        [done] = json.loads(result.stdout)["sinks"]
        assert (done["batch_id"], done["was_in_doubt"], done["outcome"]) == (3, True,
                                                                            "committed")
        assert done["aborted"] == [loser.transactional_id]
        assert read_committed(bootstrap, topic) == [b"p0", b"p1"]
        after = json.loads(dw("status", "--db", db, "-b", bootstrap, "--json").stdout)
        [entry] = after["sinks"]
        assert entry["in_doubt"] is False and entry["lingering"] == []
    finally:
        engine.dispose()


# -- issue 31: honest waits, exit codes, Ctrl-C, status's read-only and output checks ---------


def test_an_unanswered_bootstrap_says_so_and_reports_the_real_wait(db: str) -> None:
    """After ~2 s a line on stderr says what is awaited; the error gives the time really
    waited (not the 0.2 s floor of an expired deadline) and no kafka-python traceback."""
    started = time.monotonic()
    result = dw("status", "--db", db, "-b", f"127.0.0.1:{closed_port()}", "--timeout", "3")
    took = time.monotonic() - started
    assert result.returncode == 4, result.stderr
    assert "connecting to Kafka at 127.0.0.1:" in result.stderr
    # What is left of the 3 s when the connection starts (the database was asked first).
    waiting = re.search(r"\(waiting up to ([\d.]+) s\)", result.stderr)
    assert waiting and 2.0 <= float(waiting[1]) <= 3.0, result.stderr
    said = re.search(r" in ([\d.]+) s \(timeout ([\d.]+) s", result.stderr)
    assert said and said[2] == waiting[1], result.stderr
    assert abs(float(said[1]) - float(said[2])) <= 0.5, result.stderr
    assert "within 0.2 s" not in result.stderr and "Traceback" not in result.stderr
    assert took < 3 + 3


def test_an_unresolvable_bootstrap_host_fails_at_once(db: str) -> None:
    started = time.monotonic()
    result = dw("status", "--db", db, "-b", "no-such-host.invalid:9092", "--timeout", "20")
    assert result.returncode == 4, result.stderr
    assert "cannot resolve host 'no-such-host.invalid'" in result.stderr
    assert time.monotonic() - started < 8  # not the 20 s timeout


@pytest.mark.parametrize("what", ["database", "role"])
def test_a_database_or_role_that_does_not_exist_is_a_configuration_error(
        postgres_url: str, bootstrap: str, what: str) -> None:
    """Exit 2 (fix the URL), not 4 (retry); the password never shows."""
    url = dualwrite.database.normalize_url(postgres_url)
    url = (url.set(database="no_such_db_31") if what == "database"
           else url.set(username="no_such_role_31", password="s3cret-pw"))
    result = dw("status", "--db", url.render_as_string(hide_password=False), "-b", bootstrap,
                "--timeout", "10")
    assert result.returncode == 2, result.stderr
    assert "refused the connection" in result.stderr
    assert f'{what} "no_such_' in result.stderr
    assert "s3cret-pw" not in result.stderr + result.stdout


def test_ctrl_c_exits_130_with_one_line(db: str) -> None:
    proc = subprocess.Popen(
        [*dualwrite_command(), "status", "--db", db, "-b", f"127.0.0.1:{closed_port()}",
         "--timeout", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted"
    assert "Aborted!" not in err and "Traceback" not in err


def test_status_does_not_create_a_missing_sqlite_file(tmp_path: Path) -> None:
    missing = tmp_path / "fresh.db"
    result = dw("status", "--db", f"sqlite:///{missing}", "-b", "127.0.0.1:9092")
    assert result.returncode == 2
    assert "no such database file" in result.stderr
    assert not missing.exists()


def test_status_refuses_json_with_prometheus(db: str) -> None:
    result = dw("status", "--db", db, "-b", "127.0.0.1:9092", "--json", "--prometheus")
    assert result.returncode == 2
    assert "--json and --prometheus exclude each other" in result.stderr


def test_status_columns_fit_long_transactional_ids(db: str, bootstrap: str,
                                                   store: Any) -> None:
    long_id = "orders-service-" + "x" * 60
    store.claim([long_id])
    result = dw("status", "--db", db, "-b", bootstrap, "--timeout", "20")
    lines = result.stdout.splitlines()
    header = lines[0]
    row = next(line for line in lines if line.startswith(long_id))
    # Every column after the id starts where its heading does.
    for heading in ("condition", "broker state"):
        assert row[header.index(heading) - 1] == " ", (header, row)
    assert header.index("condition") > len(long_id)
