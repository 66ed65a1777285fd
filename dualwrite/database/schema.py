"""dualwrite's own tables, defined once.

:data:`METADATA` is what the migrations in ``dualwrite/database/migrations`` create (their
``target_metadata``); the state store, the decision log and :func:`~dualwrite.database.check_schema`
use these definitions, and ``tests/database/test_schema.py`` checks that a migrated database
matches them.
A new column goes into both a new migration and this module.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

__all__ = [
    "BATCH_PARTICIPANT",
    "BATCH_SINK",
    "CONSUMER_POSITION",
    "CONSUMER_POSITION_TABLE",
    "MAX_LENGTH",
    "MAX_SINK_ID",
    "METADATA",
    "PARTICIPANT_TABLE",
    "SINK_TABLE",
    "STATE_TABLE",
    "TRANSACTION_STATE",
    "UPDATED_AT_TYPE",
    "VERSION_TABLE",
    "include_name",
    "state_table",
]

#: dualwrite's state table, created by migration 0001.
STATE_TABLE = "dualwrite_transaction_state"
#: The batch sinks' decisions and their participants, created by migration 0002.
SINK_TABLE = "dualwrite_batch_sink"
PARTICIPANT_TABLE = "dualwrite_batch_participant"
#: The exactly-once consumers' decided input positions and partition owners, migration 0004.
CONSUMER_POSITION_TABLE = "dualwrite_consumer_position"
#: Alembic version table of dualwrite's own migrations (not the application's ``alembic_version``)
VERSION_TABLE = "dualwrite_alembic_version"

#: Longest transactional id and prepared-state string the tables hold (VARCHAR(255)).
MAX_LENGTH = 255
#: Longest sink id; transactional ids add a suffix and must stay within :data:`MAX_LENGTH`.
MAX_SINK_ID = 200

#: The state row's ``updated_at``: on MariaDB ``DATETIME(6)`` (microseconds), because there it
#: is also the row's version, which every write raises (see CommitInquiry.commit_status).
UPDATED_AT_TYPE = sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql",
                                                           "mariadb")

# Primary keys are named pk_<table>, as the migrations name them.
_NAMING = {"pk": "pk_%(table_name)s"}

METADATA = sa.MetaData(naming_convention=_NAMING)


def _state_table(name: str, metadata: sa.MetaData) -> sa.Table:
    return sa.Table(
        name, metadata,
        sa.Column("transactional_id", sa.String(MAX_LENGTH), primary_key=True),
        # DEFAULT '' (as text: Alembic's compare on SQLite misreads an empty string default)
        sa.Column("prepared_txn_state", sa.String(MAX_LENGTH), nullable=False,
                  server_default=sa.text("''")),
        sa.Column("updated_at", UPDATED_AT_TYPE, nullable=False),
        sa.Column("fencing_generation", sa.BigInteger, nullable=False, server_default="0"),
    )


#: One row per transactional id: the prepared state its last decided transaction committed.
TRANSACTION_STATE = _state_table(STATE_TABLE, METADATA)

#: Per batch sink: the last decided batch and whether all its participants were committed.
BATCH_SINK = sa.Table(
    SINK_TABLE, METADATA,
    sa.Column("sink_id", sa.String(MAX_SINK_ID), primary_key=True),
    sa.Column("last_batch_id", sa.BigInteger, nullable=False),
    sa.Column("completed", sa.Boolean, nullable=False),
    sa.Column("decided_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
    # The decided batch's staged rows still to move into the target (migration 0005): JSON,
    # cleared by the apply transaction that marks the batch completed.
    sa.Column("pending_apply", sa.Text, nullable=True),
)

#: The prepared participants of each sink's last decided batch.
BATCH_PARTICIPANT = sa.Table(
    PARTICIPANT_TABLE, METADATA,
    sa.Column("sink_id", sa.String(MAX_SINK_ID), primary_key=True),
    sa.Column("transactional_id", sa.String(MAX_LENGTH), primary_key=True),
    sa.Column("batch_id", sa.BigInteger, nullable=False),
    sa.Column("partition_id", sa.Integer, nullable=False),
    sa.Column("prepared_txn_state", sa.String(MAX_LENGTH), nullable=False),
    sa.Column("records", sa.BigInteger, nullable=False),
)


#: Per (consumer group, topic, partition): the next input offset the last decision consumed up
#: to, and the owner that may decide for it (raised by every new assignment: the zombie fence).
CONSUMER_POSITION = sa.Table(
    CONSUMER_POSITION_TABLE, METADATA,
    sa.Column("group_id", sa.String(MAX_SINK_ID), primary_key=True),
    sa.Column("topic", sa.String(MAX_LENGTH), primary_key=True),
    sa.Column("partition_id", sa.Integer, primary_key=True),
    sa.Column("next_offset", sa.BigInteger, nullable=False),
    sa.Column("owner_generation", sa.BigInteger, nullable=False),
    sa.Column("owner", sa.String(MAX_LENGTH), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)


def state_table(name: str) -> sa.Table:
    """The state table's shape under another name (``StateStore(engine, table=name)``), on a
    MetaData of its own."""
    return _state_table(name, sa.MetaData(naming_convention=_NAMING))


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    """Alembic's ``include_name`` filter for autogenerate and compare: of the tables, only
    :data:`METADATA`'s (not the version table, nor the application's)."""
    return type_ != "table" or name in METADATA.tables
