"""The simulated Redis as a primary and one replica: writes replicate late, a failover loses the rest.

Redis replicates asynchronously and in order: the replica holds a prefix of
the primary's writes. :class:`Replication` models that over the twins
(directory, membership, state store) without touching them: after each
mutating command it records the twins' state with the time the replica will
have it (the previous one's, or later: the order is kept; the delay is drawn
from the seed), so the replica's state at any moment is the last record whose
time has come. A failover restores that record into the twins: every write
not yet replicated is gone, as when Sentinel promotes a replica after its
master's SIGKILL.

``WAIT`` is modelled as :mod:`silo.redis_util` uses it (``wait_replicas``
>= 1): a directory registration that won, and every state write or clear,
is acknowledged only once the replica has it, or when ``wait_timeout_ms``
runs out (a short wait: acknowledged anyway, counted, and the next second's
writes are not waited for); a wait cut by the master's death fails the call
(``StorageError``), as a connection lost before ``WAIT`` answered does.

A promotion also does what the register script does on a new replication
id: it starts a new fencing epoch, so no token the promoted master hands out
repeats one the dead master handed out (docs/reliability.md, "Fencing tokens
that survive a failover").
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from silo.testing.directory import InMemoryGrainDirectory
from silo.testing.membership import InMemoryMembershipTable
from silo.testing.store import InMemoryStateStore

MUTATIONS = frozenset(
    {
        # directory
        "register", "unregister", "purge_batch", "purge_silo",
        # membership (moved() records what a watcher saw: a write too)
        "new_generation", "join", "set_status", "heartbeat", "vote_dead", "vote_unreachable", "remove", "moved",
        # state
        "write", "write_stream", "clear",
    }
)  # fmt: skip
"""The twins' commands that change what Redis holds (and so replicate)."""

WAITED = frozenset({"register", "write", "write_stream", "clear"})
"""The commands the runtime follows with ``WAIT`` (silo/redis_util.py): registrations and state writes."""

EPOCH = 10**12
"""A token is ``epoch * EPOCH + counter`` (silo/cluster/directory.py)."""

MAX_LAG_S = 0.8
"""The most a write waits for the replica: every write older than this is on the replica."""

WINDOW_S = 1.0
"""How long before a planned failover the twins' states are recorded (> MAX_LAG_S)."""

_DIRECTORY = ("_entries", "_index", "_token")
_MEMBERSHIP = ("rows", "version", "heartbeats", "loads", "feed", "seen", "votes", "unreachable", "_generation", "_voted_at")
_STORE = ("_data",)


def _copy(value: Any) -> Any:
    # Two levels are enough: the twins hold dicts of immutable values or of dicts/sets of them.
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, set):
        return set(value)
    if isinstance(value, collections.deque):
        return collections.deque(value, maxlen=value.maxlen)
    return value


@dataclass(frozen=True, slots=True)
class Image:
    """What Redis held after one write: the twins' fields."""

    directory: dict[str, Any]
    membership: dict[str, Any]
    store: dict[str, Any]


@dataclass(slots=True)
class Lost:
    """What one failover lost, for the checkers."""

    at: float
    grains: set[str] = field(default_factory=set)
    """Grains whose stored state or directory entry the promoted replica does not have as the master had it."""


class Replication:
    """The replica of the twins and the failover that promotes it (see the module docstring)."""

    def __init__(
        self,
        directory: InMemoryGrainDirectory,
        membership: InMemoryMembershipTable,
        store: InMemoryStateStore,
        rng: random.Random,
        clock: Callable[[], float],
        *,
        wait_replicas: int,
        wait_timeout_s: float = 0.1,
    ) -> None:
        self.directory, self.membership, self.store = directory, membership, store
        self.rng = rng
        self.clock = clock
        self.wait_replicas = wait_replicas
        self.wait_timeout_s = wait_timeout_s
        self.term = 0
        """Raised by every failover: a ``WAIT`` begun in an older term lost its connection."""
        self.epoch = 0
        self._log: collections.deque[tuple[float, Image]] = collections.deque([(clock(), self._image())])
        self._last_at = clock()
        self._skip_until = -1.0
        self._windows: list[tuple[float, float]] = []
        """A state is recorded only in the second before a planned failover: any older write is
        on the replica by then (MAX_LAG_S), so copying the twins after every write elsewhere
        would cost a failover seed a tenth of its time for nothing."""
        self.waits = self.short = 0
        """``WAIT`` s that the replica answered / writes acknowledged short of it (a wait ran out, or not waited)."""
        self.failovers: list[Lost] = []
        self.short_writes: list[tuple[float, str, float]] = []
        """(acknowledged at, grain, replicated at) of each write acknowledged before the replica had it."""

    def _image(self) -> Image:
        d, m, s = self.directory, self.membership, self.store
        return Image(
            {f: _copy(getattr(d, f)) for f in _DIRECTORY},
            {f: _copy(getattr(m, f)) for f in _MEMBERSHIP},
            {f: _copy(getattr(s, f)) for f in _STORE},
        )

    def wrote(self) -> float:
        """After a mutating command: when the replica will have it."""
        now = self.clock()
        # Mostly a few ms behind; now and then a stalled replica (a slow link, a fork for a save).
        lag = self.rng.uniform(0.1, MAX_LAG_S) if self.rng.random() < 0.01 else min(self.rng.expovariate(1 / 0.01), 0.5)
        at = max(self._last_at, now + lag)
        self._last_at = at
        if self._recording(now):
            self._record(now, at)
        return at

    def plan(self, at: float) -> None:
        """A failover is planned at ``at``: record the twins' states in the second before it."""
        self._windows.append((at - WINDOW_S, at))

    def checkpoint(self) -> None:
        """At a window's start: the twins as they are, on the replica within MAX_LAG_S."""
        now = self.clock()
        self._record(now, max(self._last_at, now))

    def _recording(self, now: float) -> bool:
        return any(lo <= now <= hi for lo, hi in self._windows)

    def _record(self, now: float, at: float) -> None:
        log = self._log
        # Records the replica already has, but the newest of them, are never needed again.
        while len(log) > 1 and log[1][0] <= now:
            log.popleft()
        log.append((at, self._image()))

    def replicated_by(self, now: float) -> Image:
        """The replica's state at ``now``: the last record whose time has come."""
        found = self._log[0][1]
        for at, image in self._log:
            if at > now:
                break
            found = image
        return found

    async def wait(self, replicated_at: float, grain: str) -> None:
        """The ``WAIT`` after a registration or a state write (see the module docstring)."""
        import asyncio

        from silo import errors

        if self.wait_replicas < 1:
            self._short(grain, replicated_at)
            return
        now = self.clock()
        if now < self._skip_until:
            # silo/redis_util.py: a wait that ran short pauses waiting on that master for 1 s.
            self._short(grain, replicated_at)
            return
        term = self.term
        timeout = now + self.wait_timeout_s
        await asyncio.sleep(max(0.0, min(replicated_at, timeout) - now))
        if self.term != term:
            raise errors.StorageError("connection lost before WAIT answered (simulated failover)")
        if replicated_at > timeout:
            self._skip_until = self.clock() + 1.0
            self._short(grain, replicated_at)
        else:
            self.waits += 1

    def _short(self, grain: str, replicated_at: float) -> None:
        self.short += 1
        self.short_writes.append((self.clock(), grain, replicated_at))

    def fail_over(self) -> Lost:
        """The master dies now: the replica's state becomes the twins', in a new fencing epoch."""
        now = self.clock()
        self.term += 1
        promoted = self.replicated_by(now)
        lost = Lost(now)
        before_store, before_dir = self.store._data, self.directory._entries
        for key in set(before_store) | set(promoted.store["_data"]):
            if before_store.get(key) != promoted.store["_data"].get(key):
                lost.grains.add(str(key[0]))
        for grain in set(before_dir) | set(promoted.directory["_entries"]):
            if before_dir.get(grain) != promoted.directory["_entries"].get(grain):
                lost.grains.add(str(grain))
        for target, fields in ((self.directory, promoted.directory), (self.membership, promoted.membership),
                               (self.store, promoted.store)):  # fmt: skip
            for name, value in fields.items():
                setattr(target, name, _copy(value))
        # The register script sees a new replication id: a new epoch, above every token before it.
        self.epoch += 1
        self.directory._token = max(self.directory._token, self.epoch * EPOCH)
        # The old master rejoins as the replica and resyncs: from now on it holds what the new one holds.
        self._log = collections.deque([(now, self._image())])
        self._last_at = now
        self._skip_until = -1.0
        self.failovers.append(lost)
        return lost
