"""The Spark sink's fault-injection seam: pause or fail at named points, driven by an env var.

The crash tests run the sink in real Spark processes, so they cannot pass hook objects in; they
set ``DUALWRITE_SPARK_FAULTS`` instead (for executors, through ``spark.executorEnv``). The
driver side is :class:`DriverFaults`, the :class:`~dualwrite.batch.coordinator.CoordinatorHooks`
the sink gives its coordinator, also called by the sink at ``prepared`` (the tasks returned,
before the decision). The executor side is :func:`task_point`.

``DUALWRITE_SPARK_FAULTS`` holds ``;``-separated rules:

- ``pause:<point>:<batch>``: the driver prints ``DUALWRITE-PAUSED <point> <batch>`` and sleeps, so a
  test can SIGKILL it there. Points: ``prepared``, ``decided``, ``committed-one``, ``committed``,
  ``completed``.
- ``down:<point>:<batch>[:<times>]``: the driver raises ``BrokerUnreachableError`` at that point
  (as a broker restart would), the first ``times`` times (default 1) in this process.
- ``fail:<partition>:<attempt>:<batch>``: that task attempt raises after preparing its transaction
  (task point ``prepared``).
- ``kill:<partition>:<attempt>:<batch>``: that task attempt's Python worker SIGKILLs itself
  after preparing (its Kafka transaction and, write-once, its database transaction).
- ``slow:<partition>:<attempt>:<batch>:<seconds>[:<marker file>]``: that task attempt touches the
  marker file, if given, and sleeps before producing (task point ``producing``: a straggler for
  speculative execution, or a task to kill its executor under).

Unset in production; reading it costs one dict lookup per point.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from dualwrite.batch.coordinator import CoordinatorHooks
from dualwrite.errors import BrokerUnreachableError

__all__ = ["ENV", "DriverFaults", "task_point"]

ENV = "DUALWRITE_SPARK_FAULTS"
_raised: dict[str, int] = {}
"""How often each ``down`` rule has raised in this process."""


def _rules() -> list[list[str]]:
    return [rule.split(":") for rule in os.environ.get(ENV, "").split(";") if rule]


class DriverFaults(CoordinatorHooks):
    """The driver's points: the coordinator's, and ``prepared`` (called by the sink itself)."""

    def at(self, point: str, batch_id: int) -> None:
        for rule in _rules():
            if rule[:3] == ["down", point, str(batch_id)]:
                key = ":".join(rule[:3])
                if _raised.get(key, 0) < (int(rule[3]) if len(rule) > 3 else 1):
                    _raised[key] = _raised.get(key, 0) + 1
                    print(f"DUALWRITE-DOWN {point} {batch_id}", flush=True)
                    raise BrokerUnreachableError(f"injected ({ENV}): broker unreachable at "
                                                 f"{point} of batch {batch_id}")
            if rule[:3] == ["pause", point, str(batch_id)]:
                print(f"DUALWRITE-PAUSED {point} {batch_id}", flush=True)
                sys.stdout.flush()
                while True:
                    time.sleep(3600)


def task_point(point: str, partition_id: int, attempt: int, batch_id: int) -> None:
    """An executor's points: ``producing`` (the transaction just began) and ``prepared``."""
    where = [str(partition_id), str(attempt), str(batch_id)]
    for rule in _rules():
        if point == "prepared" and rule[0] == "kill" and rule[1:4] == where:
            os.kill(os.getpid(), signal.SIGKILL)
        if point == "prepared" and rule[0] == "fail" and rule[1:4] == where:
            raise RuntimeError(f"injected failure of partition {partition_id} attempt {attempt} "
                               f"batch {batch_id} after prepare")
        if point == "producing" and rule[0] == "slow" and rule[1:4] == where:
            if len(rule) > 5:
                with open(rule[5], "a"):
                    pass
            time.sleep(float(rule[4]))
