"""How a batch sink names its participants' transactional ids: a bounded pool per sink.

``<sink>-b<batch parity>-p<partition>-a<attempt>``. The driver (which sweeps the pool), the
executors (which produce under these ids) and recovery and status (which tell a sink's open
transactions from hanging ones) all name them through this module.
"""

from __future__ import annotations

import re

__all__ = ["pool_pattern", "transactional_id"]


def transactional_id(sink_id: str, batch_id: int, partition_id: int, attempt: int) -> str:
    """The pooled transactional id of one task attempt.

    Batch parity keeps a task of batch N+1 from re-initialising (and so aborting) a participant
    of batch N that a slow driver has not committed yet; the attempt number keeps retries and
    speculative copies of one partition from fencing each other.
    """
    return f"{sink_id}-b{batch_id % 2}-p{partition_id}-a{attempt}"


def pool_pattern(sink_id: str) -> re.Pattern[str]:
    """Matches (with ``fullmatch``) exactly the ids :func:`transactional_id` gives ``sink_id``."""
    return re.compile(re.escape(sink_id) + r"-b[01]-p\d+-a\d+")
