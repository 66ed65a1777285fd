"""The exactly-once consumer: consume → database rows + Kafka records, decided once per batch.

``ExactlyOnceConsumer`` runs a handler per batch of input messages in a DualWriter transaction
and records the batch's input positions in the same database decision; ``PositionStore`` is its
table of positions and partition owners (the zombie fence). See docs/design.md, "Exactly-once
consumer".
"""

from dualwrite.consumer.consumer import ConsumedMessage, ExactlyOnceConsumer, Handler
from dualwrite.consumer.positions import PositionStore

__all__ = ["ConsumedMessage", "ExactlyOnceConsumer", "Handler", "PositionStore"]
