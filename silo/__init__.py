"""redgrain's runtime: silos, the cluster client, and what they share.

Subpackages, bottom up: ``messaging`` moves calls between processes (codec,
framing, transport, router, dispatcher); ``catalog`` runs activations (turns,
timers, state handles, the grain context); ``cluster`` keeps the cluster's
shared state in Redis (membership, failure detection, directory, placement,
rebalancing, reminders, events); ``storage`` persists grain state and
checkpoints; ``testing`` holds the in-memory twins of every seam, the embedded
Redis, a fake clock and ``LocalCluster``. ``silo.Silo`` wires one process
together, ``silo.ClusterClient`` lets code outside the cluster call in.

The names below load on first use (PEP 562), so ``from silo import errors``
or ``import silo.records`` does not import the whole runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from silo import errors
    from silo.client import ClusterClient
    from silo.settings import ClientSettings, SiloSettings
    from silo.silo import Silo

_LAZY = {
    "ClientSettings": "silo.settings",
    "ClusterClient": "silo.client",
    "Silo": "silo.silo",
    "SiloSettings": "silo.settings",
}

__all__ = ["ClientSettings", "ClusterClient", "Silo", "SiloSettings", "errors"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'silo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
