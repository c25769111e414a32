"""The membership table in a dict: the Redis table's Lua rules, for unit tests.

Same contract as :class:`silo.cluster.membership.RedisMembershipTable` (the
contract tests in ``tests/silo/cluster/test_membership_contract.py`` run the
same cases on both): every status change bumps one version, a Dead row never
changes status again and takes no heartbeats, a vote against a suspect
counts only while its heartbeat is the one the voter saw, unreachable votes
count within a window and only while their voter is not Dead, and enough
votes declare the suspect Dead in the same step.

Two Redis details are reproduced because tests can observe them: rows the
scripts rewrite go through Lua's cjson, which keeps 14 significant digits of
a number (a heartbeat of ``1700000000.123456`` reads back as
``1700000000.1235``), and suspicion votes expire 60 s after the last one.
``clock`` stands in for Redis' own clock (vote stamps, that expiry).

``rows``, ``version``, ``votes`` and ``unreachable`` are public so a test may
set a world up directly.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from grains.ids import SiloAddress
from silo import errors
from silo.cluster.membership import (
    FEED_LENGTH,
    Change,
    MembershipMoves,
    MembershipTable,
    MembershipWatch,
    VoteOutcome,
)
from silo.records.membership import LIVE, MemberRow, SiloLoad, SiloStatus

SUSPICION_TTL_S = 60.0
"""The Redis table's suspicion votes expire this long after the last vote (PEXPIRE)."""


def _lua_number(x: Any) -> Any:
    """A value as cjson writes it: floats to 14 significant digits, containers recursively."""
    if isinstance(x, float):
        return float(f"{x:.14g}")
    if isinstance(x, dict):
        return {k: _lua_number(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_lua_number(v) for v in x]
    return x


def _rewritten(row: MemberRow, **changes: Any) -> MemberRow:
    """The row as a script leaves it: decoded, changed, re-encoded with cjson."""
    fields = row.model_dump(mode="json")
    fields.update(changes)
    return MemberRow.model_validate(_lua_number(fields))


class InMemoryMembershipTable:
    """A ``MembershipTable`` in a dict, with an injectable clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.rows: dict[str, MemberRow] = {}
        self.version = 0
        self.heartbeats: dict[str, float] = {}
        """Address -> last heartbeat (the row's own field counts where none is here, as in Redis)."""
        self.loads: dict[str, SiloLoad] = {}
        self.feed: deque[tuple[int, Change]] = deque(maxlen=FEED_LENGTH)
        """(version, change) for the last FEED_LENGTH changes, as the Redis stream keeps them."""
        self.seen: dict[str, dict[str, float]] = {}
        """Watcher -> watched -> the heartbeat the watcher's last :meth:`moved` read returned."""
        self.watches = 0
        """Calls of :meth:`watch` (tests count reads)."""
        self.full_reads = 0
        """Calls of :meth:`read_all` (tests count reads)."""
        self.votes: dict[str, dict[str, float]] = {}
        """Suspect -> voter -> the heartbeat the voter saw (``vote_dead``)."""
        self.unreachable: dict[str, dict[str, float]] = {}
        """Suspect -> voter -> when it voted, by ``clock`` (``vote_unreachable``)."""
        self.clock = clock
        self._generation = 0
        self._voted_at: dict[str, float] = {}
        self._merged_rows: dict[str, tuple[MemberRow, float, SiloLoad | None, MemberRow]] = {}
        """Address -> (row, heartbeat, load, the three merged): what read_all last returned."""

    async def new_generation(self) -> int:
        self._generation += 1
        return self._generation

    async def join(self, row: MemberRow) -> int:
        self.rows[row.address] = row
        self.heartbeats[row.address] = row.heartbeat
        self.loads.pop(row.address, None)
        return self._bump(row.address)

    async def set_status(self, address: str, status: SiloStatus) -> int:
        row = self.rows.get(address)
        if row is None:
            raise errors.MembershipError(f"silo {address} is not in the membership table")
        if row.status is SiloStatus.DEAD:
            raise errors.MembershipError(f"silo {address} was declared dead")
        self._change_status(address, status)
        return self.version

    async def heartbeat(self, address: str, at: float, load: SiloLoad) -> SiloStatus | None:
        row = self.rows.get(address)
        if row is None:
            return None
        if row.status is not SiloStatus.DEAD:
            self.heartbeats[address] = at
            self.loads[address] = load
        return row.status

    async def read_all(self) -> tuple[int, dict[str, MemberRow]]:
        self.full_reads += 1
        return self.version, {a: self._merged(a, r) for a, r in self.rows.items()}

    async def watch(self, version: int, heartbeats: Sequence[str] = (), loads: Sequence[str] = ()) -> MembershipWatch:
        self.watches += 1
        changes: list[Change] | None = None
        if version == self.version:
            changes = []
        elif 0 <= version < self.version:
            run = [(v, c) for v, c in self.feed if v > version]
            if run and run[0][0] == version + 1:
                changes = [c for _, c in run]
        beats = {a: self._heartbeat_of(a) for a in heartbeats if a in self.rows}
        found = {a: self.loads[a] for a in loads if a in self.loads}
        return MembershipWatch(self.version, changes, beats, found)

    async def moved(self, watcher: str, version: int, addresses: Sequence[str]) -> MembershipMoves:
        watch = await self.watch(version)
        seen = self.seen.setdefault(watcher, {})
        moved: dict[str, bool] = {}
        ages: dict[str, float] = {}
        now = self.clock()
        for a in addresses:
            cur = self._heartbeat_of(a) if a in self.rows else None
            moved[a] = seen.get(a) != cur
            if cur is not None:
                ages[a] = max(0.0, now - cur)
            if cur is None:
                seen.pop(a, None)
            else:
                seen[a] = cur
        return MembershipMoves(watch.version, watch.changes, moved, ages)

    async def vote_dead(self, suspect: str, voter: str, seen_heartbeat: float | None, needed: int) -> VoteOutcome:
        row = self.rows.get(suspect)
        if row is None:
            return VoteOutcome("gone", 0)
        if row.status is SiloStatus.DEAD:
            return VoteOutcome("dead", 0)
        if seen_heartbeat is None:  # the value the voter's detector last read
            seen_heartbeat = self.seen.get(voter, {}).get(suspect)
            if seen_heartbeat is None:
                return VoteOutcome("alive", 0)
        now = self.clock()
        votes = self.votes.setdefault(suspect, {})
        if now - self._voted_at.get(suspect, now) > SUSPICION_TTL_S:
            votes.clear()
        hb = self._heartbeat_of(suspect)
        if abs(hb - seen_heartbeat) > 1e-4:
            votes.clear()
            self._voted_at.pop(suspect, None)
            return VoteOutcome("alive", 0)
        votes[voter] = seen_heartbeat
        self._voted_at[suspect] = now
        n = sum(1 for v in votes.values() if abs(v - hb) <= 1e-4)
        return self._count(suspect, votes, n, needed)

    async def vote_unreachable(self, suspect: str, voter: str, needed: int, window_s: float) -> VoteOutcome:
        row = self.rows.get(suspect)
        if row is None:
            return VoteOutcome("gone", 0)
        if row.status is SiloStatus.DEAD:
            return VoteOutcome("dead", 0)
        if not self._not_dead(voter):
            return VoteOutcome("refused", 0)
        now = self.clock()
        votes = self.unreachable.setdefault(suspect, {})
        votes[voter] = now
        n = sum(1 for v, at in votes.items() if now - at <= window_s and self._not_dead(v))
        return self._count(suspect, votes, n, needed)

    async def remove(self, address: str) -> None:
        """Forget a row (housekeeping of dead rows); the feed says so."""
        if self.rows.pop(address, None) is not None:
            self.heartbeats.pop(address, None)
            self.loads.pop(address, None)
            self.seen.pop(address, None)
            self._merged_rows.pop(address, None)
            self._bump(address)

    # --- for tests and the directory twin ---------------------------------------
    def is_alive(self, silo: SiloAddress) -> bool:
        """Whether ``silo`` may own grains: its row is Joining, Active or ShuttingDown.

        The directory twin's ``is_alive``, as the Redis directory reads the table.
        """
        row = self.rows.get(str(silo))
        return row is not None and row.status in LIVE

    def _not_dead(self, address: str) -> bool:
        row = self.rows.get(address)
        return row is not None and row.status is not SiloStatus.DEAD

    def _count(self, suspect: str, votes: dict[str, float], n: int, needed: int) -> VoteOutcome:
        """``n`` valid votes against ``suspect``: declare it Dead once they are enough (as the
        Lua scripts' shared ending does)."""
        if n < max(1, needed):
            return VoteOutcome("voted", n)
        self._change_status(suspect, SiloStatus.DEAD)
        votes.clear()
        self._voted_at.pop(suspect, None)
        return VoteOutcome("declared", n)

    def _heartbeat_of(self, address: str) -> float:
        return self.heartbeats.get(address, self.rows[address].heartbeat)

    def _merged(self, address: str, row: MemberRow) -> MemberRow:
        heartbeat, load = self._heartbeat_of(address), self.loads.get(address)
        # Made again only when the row, its heartbeat or its load changed: n silos starting
        # each read the whole table (n² rows; a copy each was a tenth of a simulated
        # 1,000-silo start). Readers share rows as they share the feed's: none changes one.
        made = self._merged_rows.get(address)
        if made is not None and made[0] is row and made[1] == heartbeat and made[2] is load:
            return made[3]
        update: dict[str, Any] = {"heartbeat": heartbeat}
        if load is not None:
            update["load"] = load
        merged = row.model_copy(update=update)
        self._merged_rows[address] = (row, heartbeat, load, merged)
        return merged

    def _change_status(self, address: str, status: SiloStatus) -> None:
        """A status change as the scripts make it: the last heartbeat copied into the row."""
        self.rows[address] = _rewritten(self.rows[address], status=status.value, heartbeat=self._heartbeat_of(address))
        self._bump(address)

    def _bump(self, address: str) -> int:
        self.version += 1
        self.feed.append((self.version, (address, self.rows.get(address))))
        return self.version


if TYPE_CHECKING:
    _twin: MembershipTable = InMemoryMembershipTable()  # mypy holds the twin to the protocol
