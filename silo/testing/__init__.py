"""Test doubles and local clusters, public like ``trio.testing``.

In-memory twins of the seams (``InMemoryGrainDirectory``,
``InMemoryMembershipTable``, ``InMemoryStateStore``: the Redis
implementations' rules in dicts, held to the same contract tests;
``InMemoryTransport`` on an ``InMemoryNetwork``: the socket transport and
its connections with in-memory pipes for sockets), a fake clock
(``VirtualClock``) that also drives the event loop's timers,
``InProcessSilo`` (one silo's catalog on the twins, called in-process, or
wired with a real router over the transport twin) and ``InProcessCluster``
(several of those on one network and one set of twins), the
embedded Redis helper (``RedisServer``) and ``LocalCluster`` (a private
Redis plus silo subprocesses). Unit tests use the twins; cluster tests start
real processes.

The names load on first use (PEP 562): ``import silo.testing`` imports none
of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from silo.lazy import lazy_exports

if TYPE_CHECKING:
    from silo.testing.clock import VirtualClock
    from silo.testing.directory import InMemoryGrainDirectory
    from silo.testing.embedded import RedisServer
    from silo.testing.harness import InProcessCluster, InProcessSilo
    from silo.testing.local import LocalCluster, LocalSilo, SiloLaunch, SiloStartError
    from silo.testing.membership import InMemoryMembershipTable
    from silo.testing.store import InMemoryStateStore
    from silo.testing.transport import InMemoryNetwork, InMemoryTransport

_LAZY = {
    "InMemoryGrainDirectory": "silo.testing.directory",
    "InMemoryMembershipTable": "silo.testing.membership",
    "InMemoryNetwork": "silo.testing.transport",
    "InMemoryStateStore": "silo.testing.store",
    "InMemoryTransport": "silo.testing.transport",
    "InProcessCluster": "silo.testing.harness",
    "InProcessSilo": "silo.testing.harness",
    "LocalCluster": "silo.testing.local",
    "LocalSilo": "silo.testing.local",
    "RedisServer": "silo.testing.embedded",
    "SiloLaunch": "silo.testing.local",
    "SiloStartError": "silo.testing.local",
    "VirtualClock": "silo.testing.clock",
}

__all__ = [
    "InMemoryGrainDirectory",
    "InMemoryMembershipTable",
    "InMemoryNetwork",
    "InMemoryStateStore",
    "InMemoryTransport",
    "InProcessCluster",
    "InProcessSilo",
    "LocalCluster",
    "LocalSilo",
    "RedisServer",
    "SiloLaunch",
    "SiloStartError",
    "VirtualClock",
]

__getattr__ = lazy_exports(__name__, _LAZY)
