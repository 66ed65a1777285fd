"""PulsarDualWriterPool: many requests at once over a bounded set of Pulsar writer ids (needs
the ``pulsar`` extra; see docs/pulsar.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Concatenate, ParamSpec, TypeVar

from sqlalchemy import Engine

from dualwrite.errors import ConfigurationError
from dualwrite.writer.hooks import HeuristicHook
from dualwrite.writer.pool.policy import CommitPolicy
from dualwrite.writer.pool.pool import WriterPool
from dualwrite.writer.pool.single import SingleCommit
from dualwrite.writer.pulsar_writer import PulsarDualWriter, PulsarPhaseHooks, PulsarTransaction
from dualwrite.writer.transaction_handle import transaction_context

_P = ParamSpec("_P")
_T = TypeVar("_T")


class PulsarDualWriterPool(WriterPool[PulsarDualWriter]):
    """A thread-safe pool of :class:`~dualwrite.pulsar.PulsarDualWriter` over writer ids
    ``{id_prefix}-{n}``, taken and kept like :class:`~dualwrite.writer.DualWriterPool`'s (a
    slot per id held for the pool's life, so two processes never run one id; what the prefix's
    free ids left in doubt finished at start).

    ``with pool.transaction() as tx:`` runs one request atomically on a writer of its own
    (``tx.connection``, ``tx.send``), waiting up to ``acquire_timeout_s`` for one to be free
    (then :class:`~dualwrite.errors.RetriableError`). Each request is its own Pulsar
    transaction: there is no group commit over Pulsar yet. A writer that raised a dualwrite
    error other than a lock timeout is closed and replaced before the next request.

    The ``PulsarDualWriter`` keywords (``txn_timeout_s``, ``timeout_s``, ``token``,
    ``on_heuristic_abort``, ``hooks``) apply to every writer; each writer's anchor topic is
    ``dualwrite-anchor-{id_prefix}-{n}``. Keep ``id_prefix`` apart from the ids of Kafka
    writers: their state rows share a table.
    """

    def __init__(self, engine: Engine | str, service_url: str, *,
                 id_prefix: str = "dualwrite-pulsar", size: int = 16,
                 acquire_timeout_s: float = 30.0, timeout_s: float = 30.0,
                 txn_timeout_s: float = 60.0, token: str | None = None,
                 on_heuristic_abort: HeuristicHook | None = None,
                 hooks: PulsarPhaseHooks | None = None, max_ids: int = 1024,
                 warm_up: bool = True) -> None:
        if not isinstance(service_url, str) or not service_url:
            raise ConfigurationError("PulsarDualWriterPool needs a service URL "
                                     "(pulsar://host:port)")
        self._service_url = service_url
        self._txn_timeout_s = txn_timeout_s
        self._token = token
        self._on_heuristic_abort = on_heuristic_abort
        self._hooks = hooks
        # Pulsar needs no rest between one writer's transactions: each is a new TxnID, and
        # nothing waits for the last one's markers.
        super().__init__(engine, id_prefix=id_prefix, size=size,
                         acquire_timeout_s=acquire_timeout_s, timeout_s=timeout_s,
                         max_ids=max_ids, warm_up=warm_up, rest_s=0.0)

    def _new_writer(self, tid: str) -> PulsarDualWriter:
        return PulsarDualWriter(self._engine, self._service_url, writer_id=tid,
                                txn_timeout_s=self._txn_timeout_s, timeout_s=self._timeout_s,
                                token=self._token, on_heuristic_abort=self._on_heuristic_abort,
                                hooks=self._hooks, state_store=self._store)

    def _make_policy(self) -> CommitPolicy:
        return SingleCommit(self._admission, self._all, self._usage,
                            acquire_timeout_s=self._acquire_timeout_s)

    @transaction_context("pool.transaction")
    def transaction(self) -> Iterator[PulsarTransaction]:
        """One request, atomic on both sides (class docstring)."""
        with self._policy.transaction() as tx:
            yield tx

    def run(self, fn: Callable[Concatenate[PulsarTransaction, _P], _T], /,
            *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """One request as a callable: ``fn(tx, *args, **kwargs)`` in the calling thread, in a
        transaction of its own; what it returned, once committed on both sides."""
        with self._policy.transaction() as tx:
            return fn(tx, *args, **kwargs)

    def __repr__(self) -> str:
        return (f"PulsarDualWriterPool(id_prefix={self._prefix!r}, "
                f"size={len(self.transactional_ids)})")
