"""The development form of the library's topic reader: a bootstrap string in, (records,
unfinished partitions) out, for tests, benchmarks and scripts. The reader itself is
:func:`dualwrite.participant.topic_reader.read_committed`."""

from __future__ import annotations

from dualwrite.participant.topic_reader import read_committed as read_topic

__all__ = ["read_committed"]


def read_committed(bootstrap: str, topic: str, *, timeout_s: float = 60.0
                   ) -> tuple[list[tuple[bytes | None, bytes | None]], list[int]]:
    """Every (key, value) a read_committed consumer sees in ``topic`` now, up to each
    partition's last stable offset when the consumer gets there (no wait for open
    transactions), and the partitions it could not read that far within ``timeout_s``."""
    read = read_topic({"bootstrap.servers": bootstrap}, topic, timeout_s=timeout_s,
                      wait_for_open=False)
    return list(read.records), list(read.unfinished)
