"""Notices when librdkafka may have sent one EndTxn twice, from its log.

librdkafka re-sends EndTxn by itself when the coordinator connection breaks or the request times
out (measured with librdkafka 2.16.0: the application's ``commit_transaction()`` just succeeds).
The first copy may still reach the coordinator later — the network delayed it, or the kernel
still retransmits it for the closed socket — and on the TV1 path librdkafka keeps one (producer
id, epoch) for its whole session, so that copy would commit or abort the session's *next*
transaction (KAFKA-17754, Jepsen's Bufstream analysis). librdkafka says so only in its log
(``FAIL`` or ``REQTMOUT`` on ``TxnCoordinator``), not in ``error_cb``: this logger sees those
lines and passes every line on to the application's logger (or ``dualwrite.librdkafka``).
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

__all__ = ["CoordinatorLinkWatch"]

_TROUBLE_FACILITIES = ("FAIL", "REQTMOUT")


class CoordinatorLinkWatch:
    """Installed as librdkafka's ``logger``; counts broken or timed-out coordinator links."""

    def __init__(self, config: MutableMapping[str, Any]) -> None:
        self._forward: Any = config.get("logger") or logging.getLogger("dualwrite.librdkafka")
        self.troubles = 0
        """How many times the coordinator connection failed or timed a request out so far."""
        config["logger"] = self

    def log(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        """confluent-kafka's call: ``log(level, "%s [%s] %s", facility, name, text)``."""
        if len(args) == 3 and args[0] in _TROUBLE_FACILITIES and "TxnCoordinator" in str(args[2]):
            self.troubles += 1
        self._forward.log(level, msg, *args, **kwargs)
