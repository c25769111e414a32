"""Consistent snapshots of groups of grains (training checkpoints all shards at one step).

A *snapshot* is ``(group, snapshot_id)`` with a fixed list of *members* (grain
ids). Each member saves its own state into it; the first save writes the
manifest (members, order, retention), and the save that makes every member
present marks the snapshot complete and moves it into the group's index, all
in one Lua script, so a snapshot is listed only once every member has written.
That same script applies retention: only the newest ``keep`` complete
snapshots survive, and unfinished snapshots older than the oldest survivor are
deleted with their data.

Keys (``silo/keys.py``)::

    ckpt:{group}                      zset: complete snapshot ids, scored by order
    ckptpending:{group}               zset: started, incomplete snapshot ids
    ckpt:{group}:{snap}               hash: the manifest
    ckpt:{group}:{snap}:m:{member}    hash like a state head (inline or chunked)
    ckpt:{group}:{snap}:m:{member}:v{etag}:{i}   chunks of a big member state

Integer snapshot ids (training steps) are ordered by value; other ids by the
time their first member saved. Ids and group names may not contain ``:``.
Member data is streamed with the state store's chunk code (:class:`Blobs`), so
a 200 MB shard is never held twice in memory and appears only when whole.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from grains.ids import GrainId
from silo import errors
from silo.codec import Encoded
from silo.keys import Keys
from silo.settings import StorageSettings
from silo.storage.store import (
    LUA_BLOBS,
    Blobs,
    RedisStateStore,
    StoredState,
    parse_stream,
    stream_parts,
)

_LUA_DELETE = """
local function delete_snapshot(gbase, snap)
  local manifest = gbase .. snap
  local m = redis.call('HGET', manifest, 'members')
  if m then
    for _, member in ipairs(cjson.decode(m)) do
      local head = manifest .. ':m:' .. member
      local cur = redis.call('HMGET', head, 'etag', 'nchunks')
      drop(head .. ':v', cur[1], cur[2])
      redis.call('DEL', head)
    end
  end
  redis.call('DEL', manifest)
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: member head, directory entry of the member grain, manifest, index, pending, groups
# ARGV: token, version, nchunks, size, inline, chunk base, member, members json, order ('' = time),
#       keep, snapshot id, group base, group name
_SAVE = (
    LUA_BLOBS
    + _LUA_DELETE
    + """
if not fenced(KEYS[2], ARGV[1]) then return {0, 'fence'} end
local members = redis.call('HGET', KEYS[3], 'members')
if not members then
  local order = ARGV[9]
  if order == '' then order = tostring(now_ms()) end
  redis.call('HSET', KEYS[3], 'members', ARGV[8], 'order', order, 'keep', ARGV[10],
             'status', 'pending', 'written', 0, 'created', now_ms())
  redis.call('ZADD', KEYS[5], order, ARGV[11])
  redis.call('SADD', KEYS[6], ARGV[13])
  members = ARGV[8]
elseif members ~= ARGV[8] then
  return {0, 'members', members}
end
if redis.call('HGET', KEYS[3], 'status') == 'complete' then return {0, 'complete'} end
if not swap(KEYS[1], ARGV[6], ARGV[2], ARGV[3], ARGV[4], ARGV[5]) then return {0, 'missing'} end
redis.call('HSET', KEYS[3], 'b:' .. ARGV[7], ARGV[4])
if redis.call('HSETNX', KEYS[3], 'w:' .. ARGV[7], 1) == 1 then
  redis.call('HINCRBY', KEYS[3], 'written', 1)
end
local written = tonumber(redis.call('HGET', KEYS[3], 'written'))
if written < #cjson.decode(members) then return {1, 'partial'} end
local order = redis.call('HGET', KEYS[3], 'order')
redis.call('HSET', KEYS[3], 'status', 'complete', 'completed', now_ms())
redis.call('ZREM', KEYS[5], ARGV[11])
redis.call('ZADD', KEYS[4], order, ARGV[11])
local keep = tonumber(redis.call('HGET', KEYS[3], 'keep'))
local count = redis.call('ZCARD', KEYS[4])
if count > keep then
  for _, old in ipairs(redis.call('ZRANGE', KEYS[4], 0, count - keep - 1)) do
    delete_snapshot(ARGV[12], old)
    redis.call('ZREM', KEYS[4], old)
  end
end
local oldest = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')
if oldest[2] then
  for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', '(' .. oldest[2])) do
    delete_snapshot(ARGV[12], old)
    redis.call('ZREM', KEYS[5], old)
  end
end
return {1, 'complete'}
"""
)

# KEYS: index, pending, groups.  ARGV: snapshot id, group base, group name
# A group whose last snapshot goes leaves the groups set too: nothing of it stays in Redis.
_DELETE = (
    LUA_BLOBS
    + _LUA_DELETE
    + """
delete_snapshot(ARGV[2], ARGV[1])
local n = redis.call('ZREM', KEYS[1], ARGV[1]) + redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('SREM', KEYS[3], ARGV[3])
end
return n
"""
)


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """What the manifest of one snapshot says."""

    group: str
    snapshot_id: str
    members: list[str]
    """Grain ids (``Type/key``) that make up the snapshot."""
    written: list[str]
    """Members that have saved so far."""
    complete: bool
    order: float
    created_ms: int
    completed_ms: int | None
    bytes: int
    """Stream bytes of the saved members."""


@dataclass(frozen=True, slots=True)
class CheckpointStatistics:
    saves: int
    """Member saves committed by this process."""
    completed: int
    """Saves that completed a snapshot."""
    loads: int
    """Member states loaded from snapshots."""
    bytes_saved: int
    """Stream bytes of committed saves."""


def _name(value: str, what: str) -> str:
    if not value or ":" in value:
        raise errors.ConfigError(
            f"checkpoint {what} must be non-empty and free of ':', got {value!r}"
        )
    return value


def member_name(member: Any) -> str:
    """A member as its grain id text: accepts a GrainId, a grain reference or ``"Type/key"``."""
    gid = getattr(member, "grain_id", member)
    if isinstance(gid, GrainId):
        return str(gid)
    if isinstance(gid, str):
        return str(GrainId.parse(gid))
    raise TypeError(
        f"a snapshot member is a GrainId, a grain reference or 'Type/key', not {member!r}"
    )


class Checkpoints:
    """Snapshots of grain groups in Redis; the same class serves grains (via the silo) and clients.

    ::

        cps = Checkpoints(redis, Keys("dev"))
        info = await cps.latest_complete("job-7")
        await cps.restore_group("job-7", info.snapshot_id)
    """

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, settings: StorageSettings | None = None
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._settings = settings or StorageSettings()
        self._blobs = Blobs(redis, self._settings)
        self._save = redis.register_script(_SAVE)
        self._delete = redis.register_script(_DELETE)
        self._saves = self._completed = self._loads = self._bytes = 0

    # --- writing ----------------------------------------------------------
    async def save(
        self,
        group: str,
        snapshot_id: int | str,
        member: GrainId,
        value: Encoded,
        *,
        members: Iterable[Any],
        token: int = 0,
        keep: int | None = None,
    ) -> bool:
        """Save one member's encoded state; True when this save completed the snapshot.

        ``token`` is the saving activation's fencing token (0: unfenced), so a zombie
        shard cannot write into a snapshot.
        """
        snap = _name(str(snapshot_id), "snapshot id")
        _name(group, "group")
        names = sorted({member_name(m) for m in members})
        me = str(member)
        if me not in names:
            raise errors.ConfigError(
                f"{me} saves into snapshot {group}/{snap} but is not one of its members"
            )
        k = self._keys
        base = k.checkpoint_chunk_base(group, snap, me)
        what = f"save {me} into snapshot {group}/{snap}"
        staged = await self._blobs.stage(what, base, stream_parts(value))
        order = str(snapshot_id) if isinstance(snapshot_id, int) else ""
        keep_n = keep if keep is not None else self._settings.keep_snapshots
        if keep_n < 1:
            raise errors.ConfigError(f"keep must be at least 1, got {keep_n}")
        keys = [
            k.checkpoint_member(group, snap, me), k.directory_entry(me), k.checkpoint_manifest(group, snap),
            k.checkpoint_index(group), k.checkpoint_pending(group), k.checkpoint_groups,
        ]  # fmt: skip
        args: list[Any] = [str(token), staged.version, staged.nchunks, staged.size, staged.inline, base, me,
                json.dumps(names), order, keep_n, snap, k.checkpoint_base(group), group]  # fmt: skip
        try:
            res = await self._blobs.retry(what, lambda: self._save(keys=keys, args=args))
        except errors.StorageError:
            await self._blobs.discard(base, staged)
            raise
        if int(res[0]) != 1:
            await self._blobs.discard(base, staged)
            why = res[1].decode() if isinstance(res[1], bytes) else str(res[1])
            if why == "fence":
                raise errors.StateConflictError(
                    me, "another activation owns the grain now (fencing token mismatch)"
                )
            if why == "members":
                raise errors.StorageError(
                    f"{what}: the snapshot was started with members {res[2].decode()}, not {json.dumps(names)}"
                )
            if why == "complete":
                raise errors.StorageError(
                    f"{what}: the snapshot is complete and can no longer change"
                )
            raise errors.StorageError(f"{what}: refused ({why})")
        self._saves += 1
        self._bytes += staged.size
        done = res[1] in (b"complete", "complete")
        self._completed += done
        return done

    async def delete(self, group: str, snapshot_id: int | str) -> bool:
        """Delete a snapshot (complete or not) and its data; False if there was none."""
        snap = _name(str(snapshot_id), "snapshot id")
        k = self._keys
        n = await self._blobs.retry(
            f"delete snapshot {group}/{snap}",
            lambda: self._delete(
                keys=[k.checkpoint_index(group), k.checkpoint_pending(group), k.checkpoint_groups],
                args=[snap, k.checkpoint_base(group), group],
            ),
        )
        return bool(int(n))

    # --- reading ----------------------------------------------------------
    async def groups(self) -> list[str]:
        raw = await self._blobs.retry(
            "list checkpoint groups", lambda: self._redis.smembers(self._keys.checkpoint_groups)
        )
        return sorted(g.decode() for g in raw)

    async def list(self, group: str, *, pending: bool = False) -> list[SnapshotInfo]:
        """Complete snapshots of a group, oldest first (``pending=True``: the unfinished ones)."""
        key = (
            self._keys.checkpoint_pending(group) if pending else self._keys.checkpoint_index(group)
        )
        ids = await self._blobs.retry(
            f"list snapshots of {group}", lambda: self._redis.zrange(key, 0, -1)
        )
        found = [await self.info(group, i.decode()) for i in ids]
        return [f for f in found if f is not None]

    async def latest_complete(self, group: str) -> SnapshotInfo | None:
        key = self._keys.checkpoint_index(group)
        ids = await self._blobs.retry(
            f"latest snapshot of {group}", lambda: self._redis.zrange(key, -1, -1)
        )
        return await self.info(group, ids[0].decode()) if ids else None

    async def info(self, group: str, snapshot_id: int | str) -> SnapshotInfo | None:
        snap = _name(str(snapshot_id), "snapshot id")
        key = self._keys.checkpoint_manifest(group, snap)
        raw = await self._blobs.retry(
            f"read snapshot {group}/{snap}", lambda: self._redis.hgetall(key)
        )
        if not raw or b"members" not in raw:
            return None
        m = {k.decode(): v.decode() for k, v in raw.items()}
        return SnapshotInfo(
            group=group,
            snapshot_id=snap,
            members=json.loads(m["members"]),
            written=sorted(k[2:] for k in m if k.startswith("w:")),
            complete=m.get("status") == "complete",
            order=float(m.get("order", 0)),
            created_ms=int(m.get("created", 0)),
            completed_ms=int(m["completed"]) if "completed" in m else None,
            bytes=sum(int(v) for k, v in m.items() if k.startswith("b:")),
        )

    async def load_stream(
        self, group: str, snapshot_id: int | str | None, member: Any
    ) -> tuple[memoryview, str]:
        """One member's saved stream and the snapshot id it came from (None: the latest complete).

        Raises StorageError when the snapshot is missing, incomplete or lacks the member.
        """
        if snapshot_id is None:
            latest = await self.latest_complete(group)
            if latest is None:
                raise errors.StorageError(f"checkpoint group {group!r} has no complete snapshot")
            snap = latest.snapshot_id
        else:
            snap = _name(str(snapshot_id), "snapshot id")
            info = await self.info(group, snap)
            if info is None or not info.complete:
                state = "is incomplete" if info is not None else "does not exist"
                raise errors.StorageError(f"snapshot {group}/{snap} {state}")
        me = member_name(member)
        k = self._keys
        found = await self._blobs.load(
            f"load {me} from snapshot {group}/{snap}",
            k.checkpoint_member(group, snap, me),
            k.checkpoint_chunk_base(group, snap, me),
        )
        if found is None:
            raise errors.StorageError(f"snapshot {group}/{snap} holds no state for {me}")
        self._loads += 1
        return found[0], snap

    async def load(
        self, group: str, snapshot_id: int | str | None, member: Any
    ) -> tuple[StoredState, str]:
        """Like :meth:`load_stream`, sliced for the codec (the state is a map of field values)."""
        stream, snap = await self.load_stream(group, snapshot_id, member)
        return parse_stream(stream, snap), snap

    async def restore_group(
        self, group: str, snapshot_id: int | str, store: RedisStateStore | None = None
    ) -> builtins.list[str]:
        """Overwrite every member's persisted state with the snapshot; returns the members.

        Meant for a stopped group. A live activation of a member keeps its old state in
        memory until its next write, which is then refused (etag) and makes it reload.
        """
        info = await self.info(group, snapshot_id)
        if info is None or not info.complete:
            raise errors.StorageError(f"snapshot {group}/{snapshot_id} is missing or incomplete")
        store = store or RedisStateStore(self._redis, self._keys, self._settings)
        for member in info.members:
            stream, _ = await self.load_stream(group, info.snapshot_id, member)
            await store.write_stream(GrainId.parse(member), [stream], "*", 0)
            del stream
        return info.members

    def statistics(self) -> CheckpointStatistics:
        return CheckpointStatistics(
            saves=self._saves, completed=self._completed, loads=self._loads, bytes_saved=self._bytes
        )
