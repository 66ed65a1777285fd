"""What a DualWriter's parts share: its id, Kafka config, timeout, store and callbacks."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import Engine

from dualwrite import metrics
from dualwrite.writer.hooks import HeuristicHook, PhaseHooks
from dualwrite.writer.state_store import StateStore

__all__ = ["WriterSettings", "log"]

# One logger for all the writer's parts: operators and tests filter on its name.
log = logging.getLogger("dualwrite.writer.dual_writer")


@dataclass(frozen=True)
class WriterSettings:
    """A DualWriter's fixed settings, checked by its constructor."""

    transactional_id: str
    kafka_config: dict[str, Any]
    timeout_s: float
    engine: Engine
    store: StateStore
    on_heuristic_abort: HeuristicHook | None
    hooks: PhaseHooks
    verify: Literal["auto", "always"]
    role: metrics.Role
    take_over: bool
