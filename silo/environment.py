"""What a silo takes from the process and the machine it runs in, as one explicit seam.

A :class:`~silo.silo.Silo` opens a Redis connection from its URL, listens on
a TCP socket, beats its heartbeat from a thread of its own, probes peers with
bare TCP handshakes, draws placements from an OS-seeded generator, and stamps
its membership row with the host's name, its pid and psutil's readings. Each
is right for a process and wrong for the simulator (``silo/testing/sim``),
which runs several silos on one virtual-time event loop with no socket, no
thread and one seed. :class:`SiloEnvironment` names those few things; every
field's default (``None``) is the production behaviour, so
``Silo(settings)`` is unchanged, and ``Silo(settings, environment=...)``
replaces only what it sets. Nothing here is global: two silos in one
process may have two environments.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from silo.cluster.failure_detector import Handshake, HeartbeatStatistics
    from silo.codec import Codec
    from silo.keys import Keys
    from silo.messaging.transport import Transport
    from silo.records.membership import SiloLoad
    from silo.settings import MembershipSettings, TransportSettings


class Heartbeat(Protocol):
    """What a silo asks of its heartbeat (:class:`~silo.cluster.failure_detector.HeartbeatThread`,
    or a stand-in keeping the same :class:`~silo.cluster.failure_detector.Liveness` rule)."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def fenced(self) -> bool: ...

    async def confirm(self, timeout_s: float) -> bool: ...

    def probed(self, monitor: str) -> None: ...

    def watch_monitors(self, monitors: Iterable[str]) -> None: ...

    def statistics(self) -> HeartbeatStatistics: ...


@dataclass(frozen=True, slots=True)
class HeartbeatSpec:
    """What a heartbeat is built from (the arguments :class:`Silo` gives a heartbeat factory)."""

    redis: aioredis.Redis
    """The silo's own client (the heartbeat thread opens its own connection from ``redis_url``)."""
    redis_url: str
    keys: Keys
    address: str
    settings: MembershipSettings
    load: Callable[[], SiloLoad]
    on_dead: Callable[[], Any]
    clock: Callable[[], float]
    """The wall clock."""
    monotonic: Callable[[], float]
    """The clock of the lease and its doubts."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SiloEnvironment:
    """The process-level seams of a silo (see the module docstring); ``None``: production's."""

    redis: Callable[[], Awaitable[aioredis.Redis]] | None = None
    """Opens the silo's Redis client (None: from ``settings.redis_url``, PINGed). The silo
    closes it when it stops."""
    transport: Callable[[TransportSettings, Codec], Transport] | None = None
    """Builds the transport (None: TCP, and a Unix socket for same-host peers)."""
    heartbeat: Callable[[HeartbeatSpec], Heartbeat] | None = None
    """Builds the heartbeat (None: :class:`~silo.cluster.failure_detector.HeartbeatThread`)."""
    handshake: Handshake | None = None
    """The failure detector's bare handshake with a peer that did not answer a PING (None: TCP)."""
    monotonic: Callable[[], float] | None = None
    """The clock of timeouts, periods and ages (None: ``time.monotonic``, which is the event
    loop's clock too); the wall clock is ``Silo``'s ``clock`` argument."""
    rng: Callable[[], random.Random] = random.Random
    """A generator for placement draws (the default seeds itself from the OS)."""
    load: Callable[[int], SiloLoad] | None = None
    """The load the heartbeat publishes, given the activation count (None: psutil's readings of
    this process and machine)."""
    hostname: str | None = None
    """The membership row's host name (None: the machine's)."""
    pid: int | None = None
    """The membership row's pid (None: this process's)."""
