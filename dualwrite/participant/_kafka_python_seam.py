"""The one place dualwrite depends on kafka-python below its high-level admin API.

kafka-python's ``KafkaAdminClient`` has public methods for most of what the control plane does
(describe_configs, list_transactions, get_broker_version_data, ...), but no public way to send a
request of our choosing to a node of our choosing. The control plane needs exactly that for:

* EndTxn by (producer id, epoch) capped at v4 (transaction version 1), to finish a transaction
  another process opened — the admin client has no EndTxn at all (only the producer sends it,
  for its own producer id);
* InitProducerId v6 (KIP-939's Enable2Pc / KeepPreparedTxn) for the probe, and InitProducerId
  without producer id/epoch to fence a transactional id — no admin method either;
* DescribeTransactions / DescribeProducers / FindCoordinator / Metadata / ApiVersions sent the way
  dualwrite needs them: the public ``describe_transactions`` raises for a whole batch when one id
  is unknown and cannot forget a stale coordinator after NOT_COORDINATOR; the public
  ``describe_producers`` asks for metadata on every call. Recovery relies on per-id results,
  coordinator re-lookup and cached leaders (see ``control_plane``).

kafka-python 3.0 routes every request through ``kafka.net.KafkaConnectionManager`` on a
``kafka.net.NetworkSelector`` IO thread. Both classes are exported by ``kafka.net``, and
``KafkaAdminClient`` takes a documented ``kafka_client`` factory, so :class:`KafkaLink` builds them
itself (exactly as kafka-python's own ``KafkaNetClient`` does) and hands them to the admin client:
the admin client and the control plane share one set of connections, and no underscore name of
kafka-python is touched. What is version-sensitive is the shape of that layer (the factory hook,
``send``/``run``/``call_soon``/``bootstrap_async``/``cluster``/``broker_version_data``,
``NetworkSelector.sleep``, awaitable futures) and of the generated protocol classes (``max_version``
keyword, ``InitProducerIdRequest[6]``, field names). kafka-python marks this layer as in transition
(``KafkaNetClient`` is a "compat" shim), so the range below is checked at import, and
tests/participant/test_kafka_python_seam.py exercises every function here against a real
broker: an upgrade that renames or reshapes any of it fails there, loudly, not in a recovery.

No other dualwrite module may import ``kafka.net`` or use kafka-python's underscore names.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import kafka
from kafka import KafkaAdminClient
from kafka.net import KafkaConnectionManager, KafkaNetClient, NetworkSelector
from kafka.protocol.producer.transaction import EndTxnRequest, InitProducerIdRequest

from dualwrite.errors import FatalError

__all__ = [
    "KAFKA_PYTHON_VERSION",
    "SUPPORTED_KAFKA_PYTHON",
    "KafkaLink",
    "UnsupportedKafkaPythonError",
    "check_kafka_python_version",
    "end_txn_request",
    "init_producer_id_request",
]

T = TypeVar("T")

# The kafka-python versions this module was checked against
# (tests/participant/test_kafka_python_seam.py).
# Keep in step with the kafka-python requirement in pyproject.toml.
SUPPORTED_KAFKA_PYTHON = ">=3.0.12,<3.1"
_MIN_VERSION = (3, 0, 12)
_BELOW_VERSION = (3, 1)

KAFKA_PYTHON_VERSION: str = kafka.__version__


class UnsupportedKafkaPythonError(FatalError, ImportError):
    """The installed kafka-python is outside :data:`SUPPORTED_KAFKA_PYTHON`."""


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def check_kafka_python_version(version: str = KAFKA_PYTHON_VERSION) -> None:
    """Raise :class:`UnsupportedKafkaPythonError` unless ``version`` is in the supported range."""
    release = _release(version)
    if not release or not _MIN_VERSION <= release < _BELOW_VERSION:
        raise UnsupportedKafkaPythonError(
            f"dualwrite's control plane supports kafka-python {SUPPORTED_KAFKA_PYTHON}, found "
            f"{version}: it sends requests through kafka-python's connection manager, whose "
            "shape is only checked for that range "
            "(dualwrite/participant/_kafka_python_seam.py); install "
            f"'kafka-python{SUPPORTED_KAFKA_PYTHON}'")


check_kafka_python_version()


class KafkaLink:
    """A ``KafkaAdminClient`` plus the connection manager it runs on, to send raw requests.

    ``run`` is thread-safe: it schedules a coroutine on kafka-python's IO thread and blocks the
    caller until it is done; ``send`` and ``sleep`` are awaited inside such coroutines.
    """

    def __init__(self, **configs: Any) -> None:
        built: list[tuple[NetworkSelector, KafkaConnectionManager]] = []

        # KafkaAdminClient's documented ``kafka_client`` hook; this builds exactly what
        # kafka-python's default (KafkaNetClient with no net/manager) builds, keeping the parts.
        def client_factory(**cfg: Any) -> KafkaNetClient:
            net = NetworkSelector(**cfg)
            manager = KafkaConnectionManager(net, **cfg)
            built.append((net, manager))
            return KafkaNetClient(net=net, manager=manager, **cfg)

        self.admin = KafkaAdminClient(kafka_client=client_factory, **configs)
        if len(built) != 1:  # pragma: no cover - a kafka-python that ignores the hook
            self.admin.close()
            raise UnsupportedKafkaPythonError(
                f"kafka-python {KAFKA_PYTHON_VERSION} did not build its client through the "
                "kafka_client hook; supported: " + SUPPORTED_KAFKA_PYTHON)
        self._net, self._manager = built[0]

    def close(self) -> None:
        self.admin.close()

    def run(self, coro: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``coro(*args)`` on the IO thread; blocks, returns its value or raises."""
        result: T = self._manager.run(coro, *args)
        return result

    async def send(self, request: Any, node_id: int | None = None,
                   timeout_ms: int | None = None) -> Any:
        """Send ``request`` to ``node_id`` (None: the least loaded broker); await the response,
        for at most ``timeout_ms`` (default: the client's ``request_timeout_ms``).

        The bound covers a connection still being set up (kafka-python's own setup timeout is
        separate, 10 s and more): kafka-python buffers the request meanwhile and drops it
        unsent once its timeout has passed, so a request given up here never leaves later.
        """
        future = self._manager.send(request, node_id=node_id, request_timeout_ms=timeout_ms)
        if timeout_ms is None:
            return await future
        return await self._manager.wait_for(future, timeout_ms)

    def spawn(self, coro: Callable[..., Awaitable[T]], *args: Any) -> Awaitable[T]:
        """Start ``coro(*args)`` as its own task on the IO thread; await the result to join it.

        Called inside a coroutine that ``run`` runs, it lets that coroutine send requests to
        several brokers, or several requests to one, at once instead of one after another.
        """
        future: Awaitable[T] = self._manager.call_soon(coro, *args)
        return future

    async def sleep(self, seconds: float) -> None:
        await self._net.sleep(seconds)

    async def bootstrap(self, timeout_ms: int) -> None:
        """Fetch cluster metadata afresh from a bootstrap server (the broker list may change)."""
        await self._manager.bootstrap_async(timeout_ms)

    def broker_ids(self) -> list[int]:
        return sorted(b.node_id for b in self._manager.cluster.brokers())

    def broker_address(self, node_id: int) -> tuple[str, int]:
        broker = self._manager.cluster.broker_metadata(node_id)
        return broker.host, broker.port

    def api_versions_known(self) -> bool:
        """Whether the bootstrap connection has learned the broker's versions (ApiVersions)."""
        data = self._manager.broker_version_data
        return bool(data is not None and data.api_versions)

    def max_version(self, api_key: int) -> int | None:
        """The newest version of ``api_key`` the bootstrap broker offers (None: not offered)."""
        data = self._manager.broker_version_data
        versions = (data.api_versions if data is not None else None) or {}
        entry = versions.get(api_key)
        return None if entry is None else int(entry[1])

    def add_coordinator(self, coordinator: Any, key_type: Any, key: str) -> int:
        """Register a FindCoordinator answer's broker so that ``send`` can connect to it."""
        node: int = self._manager.cluster.add_coordinator(
            coordinator, key_type, key, synthesize_node_id=False)
        return node


def end_txn_request(transactional_id: str, producer_id: int, epoch: int, commit: bool,
                    max_version: int) -> Any:
    """EndTxn for (producer id, epoch), at most ``max_version`` (the admin API has no EndTxn)."""
    return EndTxnRequest(transactional_id=transactional_id, producer_id=producer_id,
                         producer_epoch=epoch, committed=commit, max_version=max_version)


def init_producer_id_request(transactional_id: str, transaction_timeout_ms: int,
                             version: int | None, enable_2pc: bool, keep_prepared_txn: bool
                             ) -> Any:
    """InitProducerId without producer id/epoch: exactly ``version`` if given (v6 carries
    KIP-939's flags), else the newest of v0-v5 the broker takes (no admin API sends it)."""
    fields: dict[str, Any] = {"transactional_id": transactional_id,
                              "transaction_timeout_ms": transaction_timeout_ms}
    if version is None:
        return InitProducerIdRequest(**fields, max_version=5)
    if version >= 6:
        fields.update(enable2_pc=enable_2pc, keep_prepared_txn=keep_prepared_txn)
    return InitProducerIdRequest[version](**fields)
