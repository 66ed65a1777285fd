"""The lost-COMMIT verdicts as tables: (locked row, server identity, server's answer, state row)
→ :class:`CommitStatus`, for PostgreSQL and MariaDB. No server needed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from dualwrite.writer.commit_inquiry import (
    IN_RECOVERY,
    CommitStatus,
    MysqlRow,
    PostgresqlAnswer,
    PostgresqlRow,
    asks_id,
    id_decides,
    mysql_verdict,
    postgresql_verdict,
    same_history,
    same_mysql_server,
)
from dualwrite.writer.state_store import StateRow

pytestmark = pytest.mark.unit

COMMITTED, ABORTED, IN_PROGRESS = (CommitStatus.COMMITTED, CommitStatus.ABORTED,
                                   CommitStatus.IN_PROGRESS)
LOCKED_AT = datetime(2026, 11, 27, 10, 0, tzinfo=UTC)
WRITTEN_AT = LOCKED_AT + timedelta(microseconds=1)
STATE = "state-new"
GENERATION = 3

# -- PostgreSQL ---------------------------------------------------------------------------------

#: A transaction id one epoch up: its row version's xmin is the id modulo 2**32.
XID = 2**32 + 123_456
HERE = "00000001/2026-11-27 09:00:00+00/2026-11-27 09:00:00+00"
RESTARTED = "00000001/2026-11-27 11:00:00+00/2026-11-27 11:00:00+00"  # same timeline
PROMOTED = "00000002/2026-11-27 11:00:00+00/2026-11-27 11:00:00+00"  # a new timeline
PG_LOCKED = StateRow("tid", "state-old", LOCKED_AT, GENERATION, XID, 42, HERE)
UNNAMED = StateRow("tid", "state-old", LOCKED_AT, GENERATION, XID, 42, None)

#: The version this transaction wrote; the one it locked (ended, or not yet in the snapshot);
#: that one after a claim; this state in a version another transaction wrote.
MINE = PostgresqlRow(STATE, XID % 2**32, GENERATION, ended=True)
LOCKED_VERSION = PostgresqlRow("state-old", 999, GENERATION, ended=True)
NOT_ENDED = PostgresqlRow("state-old", 999, GENERATION, ended=False)
CLAIMED = PostgresqlRow("state-old", 999, GENERATION + 1, ended=True)
REPLAYED = PostgresqlRow(STATE, 999, GENERATION, ended=True)


def _asked(server: str, status: CommitStatus | None = None,
           future: bool = False) -> PostgresqlAnswer:
    return PostgresqlAnswer(server, status, future)


@pytest.mark.parametrize("locked,answer,row,verdict", [
    # The server that ran it: its word stands, and the row is not read.
    pytest.param(PG_LOCKED, _asked(HERE, COMMITTED), None, COMMITTED, id="same-committed"),
    pytest.param(PG_LOCKED, _asked(HERE, ABORTED), None, ABORTED, id="same-aborted"),
    pytest.param(PG_LOCKED, _asked(HERE, IN_PROGRESS), None, IN_PROGRESS,
                 id="same-in-progress"),
    pytest.param(PG_LOCKED, _asked(HERE, None), None, None, id="same-too-old"),
    pytest.param(PG_LOCKED, _asked(HERE, future=True), None, ABORTED, id="same-never-reached"),
    # A lock that named no server: taken at its word unless the id is in the future.
    pytest.param(UNNAMED, _asked(HERE, COMMITTED), None, COMMITTED, id="unnamed-committed"),
    pytest.param(UNNAMED, _asked(HERE, None), None, None, id="unnamed-too-old"),
    pytest.param(UNNAMED, _asked(HERE, future=True), MINE, COMMITTED, id="unnamed-future-mine"),
    pytest.param(UNNAMED, _asked(HERE, future=True), LOCKED_VERSION, None,
                 id="unnamed-future-locked-version"),
    # A crash restart (same timeline): the id may be another transaction's; the row decides.
    pytest.param(PG_LOCKED, _asked(RESTARTED, COMMITTED), MINE, COMMITTED,
                 id="restart-row-mine"),
    pytest.param(PG_LOCKED, _asked(RESTARTED, COMMITTED), LOCKED_VERSION, ABORTED,
                 id="restart-reused-id-committed"),
    pytest.param(PG_LOCKED, _asked(RESTARTED, ABORTED), LOCKED_VERSION, ABORTED,
                 id="restart-aborted"),
    pytest.param(PG_LOCKED, _asked(RESTARTED, IN_PROGRESS), LOCKED_VERSION, IN_PROGRESS,
                 id="restart-still-running"),
    pytest.param(PG_LOCKED, _asked(RESTARTED, ABORTED), NOT_ENDED, IN_PROGRESS,
                 id="restart-not-ended-in-snapshot"),
    pytest.param(PG_LOCKED, _asked(RESTARTED, future=True), NOT_ENDED, ABORTED,
                 id="restart-never-logged"),
    pytest.param(PG_LOCKED, _asked(RESTARTED, ABORTED), CLAIMED, None, id="restart-claimed"),
    pytest.param(PG_LOCKED, _asked(RESTARTED, COMMITTED), REPLAYED, None,
                 id="restart-state-in-another-version"),
    pytest.param(PG_LOCKED, _asked(RESTARTED, ABORTED), None, None, id="restart-row-gone"),
    # A promotion (new timeline): only this transaction's row version tells.
    pytest.param(PG_LOCKED, _asked(PROMOTED, COMMITTED), MINE, COMMITTED,
                 id="promoted-row-mine"),
    pytest.param(PG_LOCKED, _asked(PROMOTED, COMMITTED), LOCKED_VERSION, None,
                 id="promoted-locked-version"),
    pytest.param(PG_LOCKED, _asked(PROMOTED, IN_PROGRESS), LOCKED_VERSION, None,
                 id="promoted-in-progress"),
    pytest.param(PG_LOCKED, _asked(PROMOTED, future=True), LOCKED_VERSION, None,
                 id="promoted-never-reached"),
    # A standby is not asked about the id (it may lag); only a row it has counts.
    pytest.param(PG_LOCKED, _asked(IN_RECOVERY), MINE, COMMITTED, id="standby-row-mine"),
    pytest.param(PG_LOCKED, _asked(IN_RECOVERY), LOCKED_VERSION, None,
                 id="standby-locked-version"),
])
def test_postgresql_verdict(locked: StateRow, answer: PostgresqlAnswer,
                            row: PostgresqlRow | None, verdict: CommitStatus | None) -> None:
    assert postgresql_verdict(locked, STATE, answer, row) is verdict


@pytest.mark.parametrize("locked,server,asked", [
    (PG_LOCKED, HERE, True),
    (PG_LOCKED, RESTARTED, True),
    (PG_LOCKED, IN_RECOVERY, False),
    (UNNAMED, IN_RECOVERY, True),
])
def test_which_servers_are_asked_about_the_id(locked: StateRow, server: str,
                                              asked: bool) -> None:
    assert asks_id(locked, server) is asked


@pytest.mark.parametrize("locked,answer,decides", [
    (PG_LOCKED, _asked(HERE, COMMITTED), True),
    (PG_LOCKED, _asked(HERE, future=True), True),
    (PG_LOCKED, _asked(RESTARTED, COMMITTED), False),
    (UNNAMED, _asked(HERE, None), True),
    (UNNAMED, _asked(HERE, future=True), False),
])
def test_when_the_id_decides_without_the_row(locked: StateRow, answer: PostgresqlAnswer,
                                             decides: bool) -> None:
    assert id_decides(locked, answer) is decides


@pytest.mark.parametrize("now,then,same", [
    (HERE, HERE, True),
    (RESTARTED, HERE, True),
    (PROMOTED, HERE, False),
    (HERE, None, False),
    (IN_RECOVERY, HERE, False),
    (HERE, IN_RECOVERY, False),
])
def test_same_history(now: str, then: str | None, same: bool) -> None:
    assert same_history(now, then) is same


def test_postgresql_verdict_needs_a_transaction_id() -> None:
    unlocked = StateRow("tid", "", LOCKED_AT, GENERATION, None, None, HERE)
    with pytest.raises(ValueError, match="lock_row"):
        postgresql_verdict(unlocked, STATE, _asked(HERE, COMMITTED), None)


# -- MariaDB ------------------------------------------------------------------------------------

SERVER = "db1:3306@1764230400"
SAME_A_SECOND_LATER = "db1:3306@1764230401"
MY_RESTARTED = "db1:3306@1764237600"
OTHER_HOST = "db2:3306@1764230400"
MY_LOCKED = StateRow("tid", "state-old", LOCKED_AT, GENERATION, None, 17, SERVER)

#: This transaction's write; the version it locked; another state written since; this state
#: written after a claim.
WRITTEN = MysqlRow(STATE, WRITTEN_AT, GENERATION)
UNTOUCHED = MysqlRow("state-old", LOCKED_AT, GENERATION)
REWRITTEN = MysqlRow("state-other", WRITTEN_AT, GENERATION)
CLAIMED_SINCE = MysqlRow(STATE, WRITTEN_AT, GENERATION + 1)


@pytest.mark.parametrize("locked,server,alive,row,verdict", [
    # The session still runs on the same server: killed, asked again.
    pytest.param(MY_LOCKED, SERVER, True, None, IN_PROGRESS, id="alive"),
    pytest.param(MY_LOCKED, SAME_A_SECOND_LATER, True, UNTOUCHED, IN_PROGRESS,
                 id="alive-uptime-jitter"),
    # Ended on the same server: the row's version decides.
    pytest.param(MY_LOCKED, SERVER, False, WRITTEN, COMMITTED, id="ended-written"),
    pytest.param(MY_LOCKED, SERVER, False, UNTOUCHED, ABORTED, id="ended-untouched"),
    pytest.param(MY_LOCKED, SERVER, False, REWRITTEN, None, id="ended-rewritten"),
    pytest.param(MY_LOCKED, SERVER, False, CLAIMED_SINCE, None, id="ended-claimed"),
    pytest.param(MY_LOCKED, SERVER, False, None, None, id="ended-row-gone"),
    # Another incarnation or server: a listed session is not ours; only "committed" is taken.
    pytest.param(MY_LOCKED, MY_RESTARTED, True, WRITTEN, COMMITTED, id="restarted-written"),
    pytest.param(MY_LOCKED, MY_RESTARTED, True, UNTOUCHED, None, id="restarted-untouched"),
    pytest.param(MY_LOCKED, OTHER_HOST, False, WRITTEN, COMMITTED, id="failover-written"),
    pytest.param(MY_LOCKED, OTHER_HOST, False, UNTOUCHED, None, id="failover-untouched"),
    pytest.param(MY_LOCKED, OTHER_HOST, False, None, None, id="failover-row-gone"),
])
def test_mysql_verdict(locked: StateRow, server: str, alive: bool, row: MysqlRow | None,
                       verdict: CommitStatus | None) -> None:
    assert mysql_verdict(locked, STATE, server, alive, row) is verdict


@pytest.mark.parametrize("now,then,same", [
    (SERVER, SERVER, True),
    (SAME_A_SECOND_LATER, SERVER, True),
    (MY_RESTARTED, SERVER, False),
    (OTHER_HOST, SERVER, False),
    (SERVER, None, False),
    ("db1:3306@NULL", SERVER, False),
])
def test_same_mysql_server(now: str, then: str | None, same: bool) -> None:
    assert same_mysql_server(now, then) is same


def test_verdicts_read_as_their_old_strings() -> None:
    """Callers that still compare with PostgreSQL's words, or print a verdict, see no change."""
    assert [str(status) for status in CommitStatus] == ["committed", "aborted", "in progress"]
    said: str = CommitStatus.IN_PROGRESS
    assert said == "in progress"
    assert f"{CommitStatus.ABORTED}" == "aborted"
