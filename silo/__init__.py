"""redgrain's runtime: silos, the cluster client, and what they share.

Layers, bottom up: ``codec`` and ``transport`` move values between
processes; ``directory`` and ``membership`` keep the cluster's state in
Redis; ``catalog`` runs activations; ``dispatcher`` and ``router`` carry
calls in and out; ``silo`` wires one process together and ``client`` lets
code outside the cluster call in.
"""

from silo import errors
from silo.client import ClusterClient
from silo.settings import ClientSettings, SiloSettings
from silo.silo import Silo

__all__ = ["ClientSettings", "ClusterClient", "Silo", "SiloSettings", "errors"]
