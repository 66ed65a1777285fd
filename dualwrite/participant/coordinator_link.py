"""Notices when librdkafka may have sent one EndTxn twice, from its log.

librdkafka re-sends EndTxn by itself when the coordinator connection breaks or the request times
out, and the application's ``commit_transaction()`` just succeeds.
The first copy may still reach the coordinator later — the network delayed it, or the kernel
still retransmits it for the closed socket — and on the TV1 path librdkafka keeps one (producer
id, epoch) for its whole session, so that copy would commit or abort the session's *next*
transaction (KAFKA-17754, Jepsen's Bufstream analysis). librdkafka says so only in its log
(``FAIL`` or ``REQTMOUT`` on ``TxnCoordinator``), not in ``error_cb``: this logger sees those
lines and passes every line on to the application's logger (or ``dualwrite.librdkafka``).

A request that timed out while still in the connection's out-queue was never sent: librdkafka
says ``Timed out 0 in-flight, 0 retry-queued, 1 out-queue, 0 partially-sent requests`` and then
``FAIL ... 1 request(s) timed out: disconnect``, and retries the EndTxn (``_TIMED_OUT_QUEUE``).
No copy of it can arrive late, so that pair is no trouble, and counting it would start a
needless new session (docs/design.md, "Measurements behind the code").
"""

from __future__ import annotations

import logging
import re
from collections.abc import MutableMapping
from typing import Any

from dualwrite.participant.client_config import LIBRDKAFKA_LOGGER

__all__ = ["CoordinatorLinkWatch"]

_TROUBLE_FACILITIES = ("FAIL", "REQTMOUT")
_TIMED_OUT = re.compile(r"Timed out (\d+) in-flight, (\d+) retry-queued, (\d+) out-queue, "
                        r"(\d+) partially-sent")
_TIMEOUT_DISCONNECT = "request(s) timed out: disconnect"


class CoordinatorLinkWatch:
    """Installed as librdkafka's ``logger``; counts broken or timed-out coordinator links."""

    def __init__(self, config: MutableMapping[str, Any]) -> None:
        self._forward: Any = config.get("logger") or logging.getLogger(LIBRDKAFKA_LOGGER)
        self.troubles = 0
        """How many times the coordinator connection failed or timed a sent request out."""
        self._unsent_timeout = False
        """The last REQTMOUT timed out only requests that were never sent."""
        config["logger"] = self

    def log(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        """confluent-kafka's call: ``log(level, "%s [%s] %s", facility, name, text)``."""
        if len(args) == 3 and args[0] in _TROUBLE_FACILITIES and "TxnCoordinator" in str(args[2]):
            self._count(str(args[0]), str(args[2]))
        self._forward.log(level, msg, *args, **kwargs)

    def _count(self, facility: str, text: str) -> None:
        if facility == "REQTMOUT":
            timed_out = _TIMED_OUT.search(text)
            if timed_out is not None:
                in_flight, retry_queued, _queued, partial = map(int, timed_out.groups())
                self._unsent_timeout = in_flight + retry_queued + partial == 0
                if self._unsent_timeout:
                    return  # nothing of it left this process
        elif _TIMEOUT_DISCONNECT in text and self._unsent_timeout:
            self._unsent_timeout = False
            return  # the disconnect that follows that REQTMOUT
        self.troubles += 1
