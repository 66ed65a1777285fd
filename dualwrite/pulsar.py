"""Pulsar as the participant (needs the ``pulsar`` extra): the writer, its recovery, and the
names a caller handles.

``PulsarDualWriter`` writes database rows and Pulsar messages atomically through Pulsar's own
transactions, ``PulsarDualWriterPool`` serves many threads with a bounded set of them;
``recover_pulsar`` (and ``dualwrite recover --pulsar-url``) finishes what a crashed writer's
database decided. See docs/pulsar.md.
"""

from dualwrite.participant.pulsar import (
    PulsarError,
    PulsarHeuristicAbortError,
    PulsarOutcomeUnknownError,
    PulsarPreparedTxn,
    PulsarTxnClient,
)
from dualwrite.recovery.pulsar import recover_pulsar
from dualwrite.writer.pool.pulsar_pool import PulsarDualWriterPool
from dualwrite.writer.pulsar_writer import (
    PulsarDualWriter,
    PulsarPhaseHooks,
    PulsarTransaction,
    partition_for_key,
)

__all__ = [
    "PulsarDualWriter",
    "PulsarDualWriterPool",
    "PulsarError",
    "PulsarHeuristicAbortError",
    "PulsarOutcomeUnknownError",
    "PulsarPhaseHooks",
    "PulsarPreparedTxn",
    "PulsarTransaction",
    "PulsarTxnClient",
    "partition_for_key",
    "recover_pulsar",
]
