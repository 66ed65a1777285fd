"""The value types that name things on the wire: a topic partition and a producer identity.

They sit below both the prepared state and the control plane, so that the value type does not
import the wire client.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ProducerIdentity", "TopicPartition"]


@dataclass(frozen=True, order=True)
class TopicPartition:
    topic: str
    partition: int

    def __str__(self) -> str:
        return f"{self.topic}-{self.partition}"


@dataclass(frozen=True)
class ProducerIdentity:
    producer_id: int
    epoch: int
