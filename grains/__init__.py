"""The programming model: what users import to write grains.

::

    from grains import Grain

    class Greeter(Grain):
        async def hello(self, name: str) -> str:
            return f"hello {name} from {self.key}"

What a silo offers beyond the programming model is reached through the grain
that uses it, not held by ``Grain``: ``grains.checkpoints.snapshots(self)``
(checkpoints of grain groups) and ``grains.workload.workload(self)`` (a
long-running workload's shared store and progress record).
"""

from grains.base import DeactivationReason, Grain
from grains.context import PersistentState
from grains.ids import GrainId, SiloAddress
from grains.immutable import immutable
from grains.observer import NotifyResult, ObserverId, ObserverRef, ObserverSet
from grains.placement import (
    activation_count_placement,
    deactivate_on,
    grain_type,
    hash_placement,
    idle_timeout,
    immovable,
    incoming_filter,
    interleave,
    keep_alive,
    one_way,
    outgoing_filter,
    prefer_local,
    random_placement,
    read_only,
    reentrant,
    resource_placement,
    silo_role,
    stateless_worker,
    storage,
    version,
    write_behind,
)
from grains.ref import GrainRef, Ref
from grains.request_context import RequestContext
from grains.result_stream import ResultStream
from grains.startup import StartingSilo, on_silo_start
from grains.streams import Stream, StreamGap, StreamItem, subscribes

__all__ = [
    "DeactivationReason",
    "Grain",
    "GrainId",
    "GrainRef",
    "NotifyResult",
    "ObserverId",
    "ObserverRef",
    "ObserverSet",
    "PersistentState",
    "Ref",
    "RequestContext",
    "ResultStream",
    "SiloAddress",
    "StartingSilo",
    "Stream",
    "StreamGap",
    "StreamItem",
    "activation_count_placement",
    "deactivate_on",
    "grain_type",
    "hash_placement",
    "idle_timeout",
    "immovable",
    "immutable",
    "incoming_filter",
    "interleave",
    "keep_alive",
    "on_silo_start",
    "one_way",
    "outgoing_filter",
    "prefer_local",
    "random_placement",
    "read_only",
    "reentrant",
    "resource_placement",
    "silo_role",
    "stateless_worker",
    "storage",
    "subscribes",
    "version",
    "write_behind",
]
