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
from tests.support.statements import DIALECTS, ENDING, HARMLESS, SAVEPOINTS, dressed

pytestmark = pytest.mark.unit


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


@settings(max_examples=300, deadline=None)
@given(data=st.data(), dialect=st.sampled_from(DIALECTS),
       effect=st.sampled_from([Effect.ENDS, Effect.SAVEPOINT]))
def test_a_dressed_control_statement_is_always_found(data: st.DataObject, dialect: str,
                                                     effect: Effect) -> None:
    sql = data.draw(dressed(dialect, effect))
    assert effect in effects(sql, dialect), sql


def test_driver_state_of_sqlite() -> None:
    raw = sqlite3.connect(":memory:", isolation_level=None)
    assert driver_transaction(raw) is DriverTransaction.NONE
    raw.execute("BEGIN")
    assert driver_transaction(raw) is DriverTransaction.OPEN
    raw.execute("COMMIT")
    assert driver_transaction(raw) is DriverTransaction.NONE
    assert driver_transaction(object()) is DriverTransaction.UNKNOWN
