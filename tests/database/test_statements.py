"""dualwrite.database.statements and driver_state: pure logic, no server.

The lexer must find a transaction-control statement however it is dressed (comments, case,
white space, several statements in one string) and must not take the same words inside
strings, quoted identifiers, dollar quotes or comments for one.
"""

from __future__ import annotations

import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualwrite.database.driver_state import DriverTransaction, driver_transaction
from dualwrite.database.statements import Effect, effect_of, split_statements
from dualwrite.writer.handle import statement_effects

pytestmark = pytest.mark.unit

DIALECTS = ["postgresql", "mysql", "sqlite"]

ENDING = {
    "postgresql": ["COMMIT", "COMMIT WORK", "COMMIT AND CHAIN", "ROLLBACK", "ROLLBACK WORK",
                   "END", "END TRANSACTION", "ABORT", "BEGIN", "BEGIN ISOLATION LEVEL SERIALIZABLE",
                   "START TRANSACTION", "PREPARE TRANSACTION 'gid'", "COMMIT PREPARED 'gid'"],
    "mysql": ["COMMIT", "ROLLBACK", "BEGIN", "BEGIN NOT ATOMIC SELECT 1", "START TRANSACTION",
              "XA START 'x'", "SET autocommit = 1", "SET @@session.autocommit=1",
              "CREATE TABLE t2 (a int)", "ALTER TABLE t ADD b int", "DROP TABLE t",
              "TRUNCATE TABLE t", "RENAME TABLE t TO u", "LOCK TABLES t WRITE", "UNLOCK TABLES",
              "CREATE INDEX i ON t (a)", "ANALYZE TABLE t", "GRANT SELECT ON t TO u",
              "LOAD INDEX INTO CACHE t", "FLUSH TABLES"],
    "sqlite": ["COMMIT", "END", "END TRANSACTION", "ROLLBACK", "BEGIN", "BEGIN IMMEDIATE"],
}
SAVEPOINTS = ["SAVEPOINT a", "RELEASE SAVEPOINT a", "RELEASE a", "ROLLBACK TO SAVEPOINT a",
              "ROLLBACK TO a", "ROLLBACK WORK TO SAVEPOINT a", "ROLLBACK TRANSACTION TO a"]
HARMLESS = {
    "postgresql": ["SELECT 1", "INSERT INTO t VALUES ('COMMIT; ROLLBACK')",
                   "SELECT \"commit\" FROM \"rollback\"", "SELECT $$; COMMIT$$",
                   "SELECT $body$ ; END $body$", "-- COMMIT\nSELECT 1",
                   "/* /* COMMIT */ ; */ SELECT 1",
                   "SELECT E'\\'; COMMIT'", "SELECT 'it''s; COMMIT'", "CREATE TABLE t2 (a int)",
                   "DO $$ BEGIN PERFORM 1; END $$", "SELECT $1", "SELECT a$b FROM t",
                   "UPDATE t SET begin_at = now()"],
    "mysql": ["SELECT 1", "INSERT INTO t VALUES ('COMMIT; ROLLBACK')", "SELECT `commit` FROM t",
              "# COMMIT\nSELECT 1", "SELECT 'a\\'; COMMIT'", "CREATE TEMPORARY TABLE t2 (a int)",
              "DROP TEMPORARY TABLE t2", "SET @x = 1", "LOAD DATA INFILE 'f' INTO TABLE t",
              "SELECT \"x; COMMIT\""],
    "sqlite": ["SELECT 1", "INSERT INTO t VALUES ('COMMIT; ROLLBACK')", "SELECT [commit] FROM t",
               "SELECT `end` FROM t", "CREATE TABLE t2 (a int)", "-- ROLLBACK\nSELECT 1"],
}


def effects(sql: str, dialect: str) -> set[Effect]:
    return {effect_of(s, dialect) for s in split_statements(sql, dialect)}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_each_ending_statement_is_found(dialect: str) -> None:
    for sql in ENDING[dialect]:
        assert effects(sql, dialect) == {Effect.ENDS}, sql
    for sql in SAVEPOINTS:
        assert effects(sql, dialect) == {Effect.SAVEPOINT}, sql


@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_same_words_in_strings_identifiers_and_comments_are_harmless(dialect: str) -> None:
    for sql in HARMLESS[dialect]:
        assert effects(sql, dialect) <= {Effect.NONE}, sql


def test_dialect_rules() -> None:
    # MariaDB reads "--x" as minus minus x, and runs what an executable comment holds.
    assert effects("SELECT 1 --x; COMMIT", "mysql") == {Effect.NONE, Effect.ENDS}
    assert effects("/*!40101 COMMIT */", "mysql") == {Effect.ENDS}
    assert effects("/*M! COMMIT */", "mysql") == {Effect.ENDS}
    assert effects("/*!40101 COMMIT */", "postgresql") == set()
    # DDL is transactional on PostgreSQL and SQLite.
    assert effects("DROP TABLE t", "postgresql") == {Effect.NONE}
    assert effects("DROP TABLE t", "mysql") == {Effect.ENDS}
    assert statement_effects("SELECT 1; commit", "mariadb") == frozenset(
        {Effect.NONE, Effect.ENDS})
    assert split_statements(" ; ;", "postgresql") == []


_COMMENT = {
    "postgresql": st.sampled_from(["/* tag */", "-- tag\n", "/* a /* nested */ b */",
                                   "/*\n*/", "--\n"]),
    "mysql": st.sampled_from(["/* tag */", "-- tag\n", "# tag\n", "--\t\n", "/**/"]),
    "sqlite": st.sampled_from(["/* tag */", "-- tag\n", "--x\n"]),
}
_SPACE = st.sampled_from(["", " ", "\n", "\t", "  \r\n"])


def _dressed(dialect: str, effect: Effect) -> st.SearchStrategy[str]:
    """A statement of ``effect`` in random case, between random comments and white space,
    alone or among harmless statements."""
    core = st.sampled_from(ENDING[dialect] if effect is Effect.ENDS else SAVEPOINTS)
    cased = core.flatmap(lambda s: st.lists(st.booleans(), min_size=len(s), max_size=len(s))
                         .map(lambda up: "".join(c.upper() if u else c.lower()
                                                 for c, u in zip(s, up, strict=True))))
    wrap = st.lists(st.one_of(_COMMENT[dialect], _SPACE), max_size=3).map("".join)
    lone = st.tuples(wrap, cased, wrap).map(lambda t: " ".join(t))
    others = st.lists(st.sampled_from(HARMLESS[dialect]), max_size=2)
    return st.tuples(others, lone, others).map(
        lambda t: ";".join([*(s.replace(";", " ") for s in t[0]), t[1],
                            *(s.replace(";", " ") for s in t[2])]))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), dialect=st.sampled_from(DIALECTS),
       effect=st.sampled_from([Effect.ENDS, Effect.SAVEPOINT]))
def test_a_dressed_control_statement_is_always_found(data: st.DataObject, dialect: str,
                                                     effect: Effect) -> None:
    sql = data.draw(_dressed(dialect, effect))
    assert effect in effects(sql, dialect), sql


def test_driver_state_of_sqlite() -> None:
    raw = sqlite3.connect(":memory:", isolation_level=None)
    assert driver_transaction(raw) is DriverTransaction.NONE
    raw.execute("BEGIN")
    assert driver_transaction(raw) is DriverTransaction.OPEN
    raw.execute("COMMIT")
    assert driver_transaction(raw) is DriverTransaction.NONE
    assert driver_transaction(object()) is DriverTransaction.UNKNOWN
