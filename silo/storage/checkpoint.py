"""Consistent snapshots of groups of grains (training checkpoints all shards at one step).

A *snapshot* is ``(group, snapshot_id)`` with a fixed list of *members* (grain
ids). Each member saves its own state into it in three steps, **blob first,
then manifest**:

1. open (control slot): the first save writes the manifest (members, order,
   retention); a save into a complete snapshot or with other members is refused;
2. blob (the member grain's own slot): the fenced commit of the member's
   stream, checked against the grain's directory entry in the same script;
3. mark (control slot): the member is recorded as written, and the save that
   makes every member present marks the snapshot complete and moves it into
   the group's index, so a snapshot is listed only once every member's blob is
   committed. The same script applies retention: only the newest ``keep``
   complete snapshots stay listed, and unfinished snapshots older than the
   oldest survivor are unlisted; the caller then deletes their blobs and
   manifests (each blob in its own slot).

The steps are separate because a member's blob and the group's manifest live
in different hash slots on a Redis Cluster. A save that dies between 2 and 3
leaves a blob no complete snapshot lists (the member saves again, or
retention deletes it with its snapshot); one that dies during retention
leaves unlisted data of a dropped snapshot behind (a leak, never a wrong
restore: restores read only listed, complete snapshots).

Keys (``silo/keys.py``)::

    rg:{cluster}:ckpt:{group}                      zset: complete snapshot ids, scored by order
    rg:{cluster}:ckptpending:{group}               zset: started, incomplete snapshot ids
    rg:{cluster}:ckpt:{group}:{snap}               hash: the manifest
    rg:{cluster:g:<member>}:ckpt:{group}:{snap}    hash like a state head (inline or chunked)
    rg:{cluster:g:<member>}:ckpt:{group}:{snap}:v{etag}:{i}   chunks of a big member state

Integer snapshot ids (training steps) are ordered by value; other ids by the
time their first member saved. Ids and group names may not contain ``:``.
Member data is streamed with the state store's chunk code (:class:`Blobs`), so
a 200 MB shard is never held twice in memory and appears only when whole.
"""

from __future__ import annotations

import builtins
import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from grains.ids import GrainId
from silo import errors
from silo.codec import Encoded
from silo.keys import Keys, chunk_key
from silo.settings import StorageSettings
from silo.storage.store import (
    LUA_BLOBS,
    Blobs,
    RedisStateStore,
    StoredState,
    parse_stream,
    stream_parts,
)

_NOW = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: manifest, pending, groups, index.
# ARGV: members json, order ('' = time), keep, snapshot id, group, epoch ('' = none)
# Returns {1, 'opened'[, members of a snapshot of an older epoch it took over]}, {1, 'open'},
# or {0, reason, ...}.
_OPEN = (
    _NOW
    + """
local members = redis.call('HGET', KEYS[1], 'members')
local old = nil
if members and ARGV[6] ~= '' then
  local cur = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '') or -1
  local mine = tonumber(ARGV[6])
  if cur > mine then return {0, 'epoch', tostring(cur)} end
  if cur < mine then
    -- Left by an abandoned epoch (complete or not): taken over in place, so it is never
    -- listed, mixed with this epoch's members, or kept from this epoch's save.
    redis.call('DEL', KEYS[1])
    redis.call('ZREM', KEYS[4], ARGV[4])
    redis.call('ZREM', KEYS[2], ARGV[4])
    old = members
    members = nil
  end
end
if not members then
  local order = ARGV[2]
  if order == '' then order = tostring(now_ms()) end
  redis.call('HSET', KEYS[1], 'members', ARGV[1], 'order', order, 'keep', ARGV[3],
             'status', 'pending', 'written', 0, 'created', now_ms(), 'epoch', ARGV[6])
  redis.call('ZADD', KEYS[2], order, ARGV[4])
  redis.call('SADD', KEYS[3], ARGV[5])
  if old then return {1, 'opened', old} end
  return {1, 'opened'}
end
if members ~= ARGV[1] then return {0, 'members', members} end
if redis.call('HGET', KEYS[1], 'status') == 'complete' then return {0, 'complete'} end
return {1, 'open'}
"""
)

# KEYS: member head, directory entry of the member grain, the n new chunks, the m old chunks
# ARGV: token, version, n, size, inline, declared old etag, m
_BLOB = (
    LUA_BLOBS
    + """
local_keys()
if not fenced(KEYS[2], ARGV[1]) then return {0, 'fence'} end
local cur = redis.call('HMGET', KEYS[1], 'etag', 'nchunks')
if cur[1] == ARGV[2] then return {1, 'again'} end
local m = tonumber(ARGV[7])
if not declared(cur, ARGV[6], m) then return {0, 'old', cur[1] or '', cur[2] or '0'} end
if not swap(KEYS[1], 3, tonumber(ARGV[3]), ARGV[2], ARGV[4], ARGV[5], m) then return {0, 'missing'} end
return {1, 'ok'}
"""
)

# KEYS: manifest, index, pending.  ARGV: member, size, snapshot id, epoch ('' = none)
# Returns {1, 'partial'} or {1, 'complete', snapshot ids retention unlisted...}.
_MARK = (
    _NOW
    + """
local members = redis.call('HGET', KEYS[1], 'members')
if not members then return {0, 'gone'} end
if (redis.call('HGET', KEYS[1], 'epoch') or '') ~= ARGV[4] then return {0, 'epoch'} end
if redis.call('HGET', KEYS[1], 'status') == 'complete' then return {1, 'partial'} end
redis.call('HSET', KEYS[1], 'b:' .. ARGV[1], ARGV[2])
if redis.call('HSETNX', KEYS[1], 'w:' .. ARGV[1], 1) == 1 then
  redis.call('HINCRBY', KEYS[1], 'written', 1)
end
local written = tonumber(redis.call('HGET', KEYS[1], 'written'))
if written < #cjson.decode(members) then return {1, 'partial'} end
local order = redis.call('HGET', KEYS[1], 'order')
redis.call('HSET', KEYS[1], 'status', 'complete', 'completed', now_ms())
redis.call('ZREM', KEYS[3], ARGV[3])
redis.call('ZADD', KEYS[2], order, ARGV[3])
local out = {1, 'complete'}
local keep = tonumber(redis.call('HGET', KEYS[1], 'keep'))
local count = redis.call('ZCARD', KEYS[2])
if count > keep then
  for _, old in ipairs(redis.call('ZRANGE', KEYS[2], 0, count - keep - 1)) do
    redis.call('ZREM', KEYS[2], old)
    out[#out + 1] = old
  end
end
local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
if oldest[2] then
  for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. oldest[2])) do
    redis.call('ZREM', KEYS[3], old)
    out[#out + 1] = old
  end
end
return out
"""
)

# KEYS: manifest, index, pending, groups.  ARGV: snapshot id, group name
# The manifest goes after its members' blobs. A group whose last snapshot goes leaves the
# groups set too: nothing of it stays in Redis.
_FORGET = """
redis.call('DEL', KEYS[1])
local n = redis.call('ZREM', KEYS[2], ARGV[1]) + redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('SREM', KEYS[4], ARGV[2])
end
return n
"""


# KEYS: manifest, pending, index, groups.  ARGV: snapshot id, group name
# A save refused after it opened the snapshot takes the snapshot back, while no member wrote.
_ABANDON = """
if tonumber(redis.call('HGET', KEYS[1], 'written') or '-1') ~= 0 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('SREM', KEYS[4], ARGV[2])
end
return 1
"""


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


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
        self._open = redis.register_script(_OPEN)
        self._blob = redis.register_script(_BLOB)
        self._mark = redis.register_script(_MARK)
        self._forget = redis.register_script(_FORGET)
        self._abandon = redis.register_script(_ABANDON)
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
        epoch: int | None = None,
    ) -> bool:
        """Save one member's encoded state; True when this save completed the snapshot.

        ``token`` is the saving activation's fencing token (0: unfenced), so a zombie
        shard cannot write into a snapshot. ``epoch`` (a training job's generation) names
        who owns the snapshot: a save of a newer epoch takes over one an older epoch left
        (complete or not: that epoch was abandoned), one of an older epoch is refused, so
        two epochs never mix members nor block each other at the same id.
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
        order = str(snapshot_id) if isinstance(snapshot_id, int) else ""
        keep_n = keep if keep is not None else self._settings.keep_snapshots
        if keep_n < 1:
            raise errors.ConfigError(f"keep must be at least 1, got {keep_n}")
        manifest = k.checkpoint_manifest(group, snap)
        tag = "" if epoch is None else str(int(epoch))
        opened = await self._blobs.retry(what, lambda: self._open(
            keys=[manifest, k.checkpoint_pending(group), k.checkpoint_groups, k.checkpoint_index(group)],
            args=[json.dumps(names), order, keep_n, snap, group, tag],
        ))  # fmt: skip
        if int(opened[0]) != 1:
            self._refused(what, me, names, opened)
        if len(opened) > 2:  # an abandoned epoch's snapshot, taken over: its other members' blobs go
            await self._unlink_members(group, snap, [m for m in json.loads(_text(opened[2])) if m not in names])
        staged = await self._blobs.stage(what, base, stream_parts(value))
        tok = str(token)

        def argv(old: str, m: int) -> list[Any]:
            return [tok, staged.version, staged.nchunks, staged.size, staged.inline, old, m]

        head = k.checkpoint_member(group, snap, me)
        # On a StorageError the commit's fate is unknown: its chunks stay (named by the head if it
        # landed, else they expire).
        res = await self._blobs.commit(what, self._blob, [head, k.directory_entry(me)], base, staged, argv, None)
        if int(res[0]) != 1:
            await self._blobs.discard(base, staged)
            if _text(opened[1]) == "opened":
                await self._blobs.retry(what, lambda: self._abandon(
                    keys=[manifest, k.checkpoint_pending(group), k.checkpoint_index(group), k.checkpoint_groups],
                    args=[snap, group],
                ))  # fmt: skip
            self._refused(what, me, names, res)
        marked = await self._blobs.retry(what, lambda: self._mark(
            keys=[manifest, k.checkpoint_index(group), k.checkpoint_pending(group)], args=[me, staged.size, snap, tag],
        ))  # fmt: skip
        if int(marked[0]) != 1:
            if _text(marked[1]) == "epoch":
                raise errors.StorageError(f"{what}: a newer epoch took the snapshot over during the save")
            raise errors.StorageError(f"{what}: the snapshot was deleted during the save")
        for old in marked[2:]:
            await self._drop(group, _text(old))
        self._saves += 1
        self._bytes += staged.size
        done = _text(marked[1]) == "complete"
        self._completed += done
        return done

    @staticmethod
    def _refused(what: str, me: str, names: builtins.list[str], res: Any) -> None:
        why = _text(res[1])
        if why == "fence":
            raise errors.StateConflictError(me, "another activation owns the grain now (fencing token mismatch)")
        if why == "members":
            raise errors.StorageError(
                f"{what}: the snapshot was started with members {_text(res[2])}, not {json.dumps(names)}"
            )
        if why == "complete":
            raise errors.StorageError(f"{what}: the snapshot is complete and can no longer change")
        if why == "epoch":
            raise errors.StorageError(f"{what}: the snapshot belongs to newer epoch {_text(res[2])}")
        if why == "missing":
            raise errors.StorageError(f"{what}: staged chunks expired before the commit (orphan_ttl_s too short?)")
        raise errors.StorageError(f"{what}: refused ({why})")

    async def _drop(self, group: str, snap: str) -> int:
        """Delete one snapshot: its members' blobs (each in its grain's slot), then its manifest."""
        k = self._keys
        manifest = k.checkpoint_manifest(group, snap)
        what = f"delete snapshot {group}/{snap}"
        raw = await self._blobs.retry(what, lambda: self._redis.hget(manifest, "members"))
        await self._unlink_members(group, snap, json.loads(raw) if raw else [])
        n = await self._blobs.retry(what, lambda: self._forget(
            keys=[manifest, k.checkpoint_index(group), k.checkpoint_pending(group), k.checkpoint_groups],
            args=[snap, group],
        ))  # fmt: skip
        return int(n)

    async def _unlink_members(self, group: str, snap: str, members: builtins.list[str]) -> None:
        """Delete these members' blobs of a snapshot (each in its grain's slot)."""
        k = self._keys
        what = f"delete snapshot {group}/{snap}"
        for member in members:
            head = k.checkpoint_member(group, snap, member)
            base = k.checkpoint_chunk_base(group, snap, member)
            etag, n = await self._blobs.retry(what, functools.partial(self._redis.hmget, head, ["etag", "nchunks"]))
            doomed = [head, *(chunk_key(base, _text(etag), i) for i in range(int(n or 0)))] if etag else [head]
            await self._blobs.retry(what, functools.partial(self._redis.unlink, *doomed))

    async def delete(self, group: str, snapshot_id: int | str) -> bool:
        """Delete a snapshot (complete or not) and its data; False if there was none."""
        snap = _name(str(snapshot_id), "snapshot id")
        return bool(await self._drop(group, snap))

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
        if m.get("status") == "complete":
            # Complete only while listed: retention unlists a snapshot in the script that completes
            # a newer one, then its saver deletes the blobs and the manifest last. A saver killed in
            # between leaves a manifest that still says complete over deleted blobs; a restore that
            # trusted it failed forever (test_faults.py: a shard's silo SIGKILLed, keep_checkpoints 1, under load).
            listed = await self._blobs.retry(
                f"read snapshot {group}/{snap}", lambda: self._redis.zscore(self._keys.checkpoint_index(group), snap)
            )
            if listed is None:
                m["status"] = "unlisted"
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
