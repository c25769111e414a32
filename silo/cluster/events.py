"""ClusterEvents: one silo's in-process hub for cluster events.

The components that notice something (the failure detector: suspect, dead;
the rebalancer and drain: failover, rebalance, drain, leave) call
``emit(kind, data)``: it logs one line, counts the kind and calls every
listener at once, in the emitter's turn. The silo adds the dashboard's event
log as a listener (:meth:`silo.records.events.EventLog.on_event`, which queues the
write and returns), so nothing that emits waits on Redis. A failing listener
is logged and never breaks the component that emitted the event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("redgrain.membership")

EventListener = Callable[[str, dict[str, Any]], Any]

EVENT_KINDS = ("join", "suspect", "dead", "rebalance", "failover", "drain")


class ClusterEvents:
    """Cluster events of one silo: a log line each, and listeners (the dashboard's hook).

    ``add_listener(fn)`` gets ``fn(kind, data)`` for every event; kinds are
    join, suspect, dead, rebalance, failover and drain. A failing listener is
    logged and never breaks the component that emitted the event.
    """

    def __init__(self) -> None:
        self._listeners: list[EventListener] = []
        self.counts: dict[str, int] = {}

    def add_listener(self, fn: EventListener) -> None:
        self._listeners.append(fn)

    def emit(self, kind: str, data: dict[str, Any]) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        log.info("cluster event %s %s", kind, " ".join(f"{k}={v}" for k, v in data.items()))
        for fn in self._listeners:
            try:
                fn(kind, data)
            except Exception:
                log.exception("cluster event listener failed")
