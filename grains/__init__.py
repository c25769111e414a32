"""The programming model: what users import to write grains.

::

    from grains import Grain

    class Greeter(Grain):
        async def hello(self, name: str) -> str:
            return f"hello {name} from {self.key}"
"""

from grains.base import DeactivationReason, Grain
from grains.ids import GrainId, SiloAddress
from grains.immutable import immutable
from grains.placement import (
    activation_count_placement,
    deactivate_on,
    grain_type,
    hash_placement,
    idle_timeout,
    immovable,
    interleave,
    keep_alive,
    one_way,
    prefer_local,
    random_placement,
    read_only,
    reentrant,
    resource_placement,
    silo_role,
    stateless_worker,
    version,
    write_behind,
)
from grains.ref import GrainRef

__all__ = [
    "DeactivationReason",
    "Grain",
    "GrainId",
    "GrainRef",
    "SiloAddress",
    "activation_count_placement",
    "deactivate_on",
    "grain_type",
    "hash_placement",
    "idle_timeout",
    "immovable",
    "immutable",
    "interleave",
    "keep_alive",
    "one_way",
    "prefer_local",
    "random_placement",
    "read_only",
    "reentrant",
    "resource_placement",
    "silo_role",
    "stateless_worker",
    "version",
    "write_behind",
]
