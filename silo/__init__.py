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
or ``import silo.records.stats`` does not import the whole runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from silo.lazy import lazy_exports

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

__getattr__ = lazy_exports(__name__, _LAZY)
