"""Statements by what they do to their transaction, per dialect, and a strategy dressing one up
(random case, comments, white space, harmless neighbours) for the lexer's property tests."""

from __future__ import annotations

from hypothesis import strategies as st

from dualwrite.database.statements import Effect

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

COMMENT = {
    "postgresql": st.sampled_from(["/* tag */", "-- tag\n", "/* a /* nested */ b */",
                                   "/*\n*/", "--\n"]),
    "mysql": st.sampled_from(["/* tag */", "-- tag\n", "# tag\n", "--\t\n", "/**/"]),
    "sqlite": st.sampled_from(["/* tag */", "-- tag\n", "--x\n"]),
}

SPACE = st.sampled_from(["", " ", "\n", "\t", "  \r\n"])


def dressed(dialect: str, effect: Effect) -> st.SearchStrategy[str]:
    """A statement of ``effect`` in random case, between random comments and white space,
    alone or among harmless statements."""
    core = st.sampled_from(ENDING[dialect] if effect is Effect.ENDS else SAVEPOINTS)
    cased = core.flatmap(lambda s: st.lists(st.booleans(), min_size=len(s), max_size=len(s))
                         .map(lambda up: "".join(c.upper() if u else c.lower()
                                                 for c, u in zip(s, up, strict=True))))
    wrap = st.lists(st.one_of(COMMENT[dialect], SPACE), max_size=3).map("".join)
    lone = st.tuples(wrap, cased, wrap).map(lambda t: " ".join(t))
    others = st.lists(st.sampled_from(HARMLESS[dialect]), max_size=2)
    return st.tuples(others, lone, others).map(
        lambda t: ";".join([*(s.replace(";", " ") for s in t[0]), t[1],
                            *(s.replace(";", " ") for s in t[2])]))
