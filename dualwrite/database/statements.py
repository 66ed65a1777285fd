"""What an SQL string would do to the transaction it runs in, read before it is sent.

A lexer, not a parser: it splits a string into its statements the way the server would (comments,
quoted strings and identifiers, PostgreSQL's dollar quotes and nested comments, MariaDB's
executable ``/*! ... */`` comments) and reads each statement's leading keywords. That is enough
to tell the statements that end, begin or prepare a transaction, that commit implicitly on
MariaDB, or that name a savepoint, wherever they stand in the string. Where it cannot tell (a
stored procedure that commits), the driver's transaction state after the statement is the
authority (:mod:`dualwrite.database.driver_state`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Effect", "Statement", "effect_of", "split_statements"]

_WORD = re.compile(r"[A-Za-z_@][A-Za-z0-9_@$]*")
_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$")
_MYSQL_EXECUTABLE_COMMENT = re.compile(r"/\*M?!\d*")
_KEPT_WORDS = 8
"""Leading keywords kept per statement: enough for ``ROLLBACK TRANSACTION TO SAVEPOINT`` and
``SET SESSION ... autocommit``."""


@dataclass(frozen=True)
class Statement:
    """One statement of a string: its leading words, upper-cased (comments and quoted text
    left out)."""

    words: tuple[str, ...]

    def starts(self, *words: str) -> bool:
        return self.words[:len(words)] == words


class Effect(enum.Enum):
    """What a statement does to the transaction it runs in."""

    NONE = "none"
    """Runs inside it."""
    ENDS = "ends"
    """Ends, begins or prepares a transaction, or commits it implicitly (MariaDB's DDL)."""
    SAVEPOINT = "savepoint"
    """Creates, releases or rolls back to a savepoint by name."""


def split_statements(sql: str, dialect: str) -> list[Statement]:
    """The statements of ``sql`` as ``dialect`` (``postgresql``, ``mysql``, ``sqlite``) reads
    them; empty ones are left out."""
    found: list[Statement] = []
    words: list[str] = []
    for token in _tokens(sql, dialect):
        if token == ";":
            if words:
                found.append(Statement(tuple(words)))
            words = []
        elif len(words) < _KEPT_WORDS:
            words.append(token)
    if words:
        found.append(Statement(tuple(words)))
    return found


def effect_of(statement: Statement, dialect: str) -> Effect:
    """What ``statement`` does to the transaction it runs in on ``dialect``."""
    first = statement.words[0]
    if first == "ROLLBACK":
        rest = [w for w in statement.words[1:3] if w not in ("WORK", "TRANSACTION")]
        return Effect.SAVEPOINT if rest[:1] == ["TO"] else Effect.ENDS
    if first in ("SAVEPOINT", "RELEASE"):
        return Effect.SAVEPOINT
    if first in ("COMMIT", "END", "ABORT", "BEGIN") or statement.starts("START", "TRANSACTION"):
        return Effect.ENDS
    if dialect == "postgresql" and statement.starts("PREPARE", "TRANSACTION"):
        return Effect.ENDS
    if dialect == "mysql" and _commits_implicitly(statement):
        return Effect.ENDS
    return Effect.NONE


# MariaDB statements that commit the running transaction before they run (its manual, "SQL
# statements that cause an implicit commit"), by first word; CREATE/DROP TEMPORARY TABLE do not.
_MYSQL_IMPLICIT_COMMIT = frozenset({
    "ALTER", "CREATE", "DROP", "RENAME", "TRUNCATE", "LOCK", "UNLOCK", "GRANT", "REVOKE",
    "ANALYZE", "OPTIMIZE", "REPAIR", "CHECK", "CACHE", "FLUSH", "RESET", "INSTALL",
    "UNINSTALL", "XA", "SHUTDOWN"})


def _commits_implicitly(statement: Statement) -> bool:
    first = statement.words[0]
    if first in ("CREATE", "DROP") and "TEMPORARY" in statement.words[1:3]:
        return False
    if first == "LOAD":
        return statement.starts("LOAD", "INDEX")
    if first == "SET":  # SET autocommit = 1 commits; SET PASSWORD too
        return any("AUTOCOMMIT" in w for w in statement.words) or statement.starts(
            "SET", "PASSWORD")
    return first in _MYSQL_IMPLICIT_COMMIT


def _tokens(sql: str, dialect: str) -> Iterator[str]:
    """Upper-cased words and ``;`` at the top level of ``sql``: what is inside comments,
    strings and quoted identifiers is skipped."""
    mysql, postgres = dialect == "mysql", dialect == "postgresql"
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c == ";":
            yield ";"
            i += 1
        elif c == "-" and sql.startswith("--", i) and (
                not mysql or i + 2 == n or sql[i + 2] in " \t\r\n\f\v"):
            # MariaDB takes "--" as a comment only before white space ("--1" is minus minus one).
            i = _line_end(sql, i)
        elif c == "#" and mysql:
            i = _line_end(sql, i)
        elif c == "/" and sql.startswith("/*", i):
            # MariaDB runs what /*! ... */ holds: read it as code.
            executable = _MYSQL_EXECUTABLE_COMMENT.match(sql, i) if mysql else None
            i = executable.end() if executable else _comment_end(sql, i, nested=postgres)
        elif c == "*" and mysql and sql.startswith("*/", i):
            i += 2  # the end of an executable comment
        elif c == "'":
            backslash = mysql or (postgres and i > 0 and sql[i - 1] in "eE"
                                  and (i < 2 or not _is_word_char(sql[i - 2])))
            i = _quoted_end(sql, i, "'", backslash=backslash)
        elif c == '"':
            i = _quoted_end(sql, i, '"', backslash=mysql)
        elif c == "`" and not postgres:
            i = _quoted_end(sql, i, "`", backslash=False)
        elif c == "[" and dialect == "sqlite":
            end = sql.find("]", i + 1)
            i = n if end < 0 else end + 1
        elif c == "$" and postgres and (i == 0 or not _is_word_char(sql[i - 1])):
            tag = _DOLLAR_TAG.match(sql, i)
            if tag:
                end = sql.find(tag.group(), tag.end())
                i = n if end < 0 else end + len(tag.group())
            else:
                i += 1  # a parameter ($1)
        elif c.isalpha() or c in "_@":
            word = _WORD.match(sql, i)
            assert word is not None
            yield word.group().upper()
            i = word.end()
        else:
            i += 1


def _is_word_char(c: str) -> bool:
    return c.isalnum() or c in "_$"


def _line_end(sql: str, i: int) -> int:
    end = sql.find("\n", i)
    return len(sql) if end < 0 else end + 1


def _comment_end(sql: str, i: int, *, nested: bool) -> int:
    """The index after the block comment opened at ``i`` (PostgreSQL nests them)."""
    depth, i, n = 1, i + 2, len(sql)
    while i < n and depth:
        if sql.startswith("*/", i):
            depth -= 1
            i += 2
        elif nested and sql.startswith("/*", i):
            depth += 1
            i += 2
        else:
            i += 1
    return i


def _quoted_end(sql: str, i: int, quote: str, *, backslash: bool) -> int:
    """The index after the quoted text opened at ``i`` (a doubled quote stays inside)."""
    i, n = i + 1, len(sql)
    while i < n:
        c = sql[i]
        if backslash and c == "\\":
            i += 2
        elif c == quote:
            if i + 1 < n and sql[i + 1] == quote:
                i += 2
            else:
                return i + 1
        else:
            i += 1
    return n
