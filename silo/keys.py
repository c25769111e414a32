"""Every Redis key redgrain uses, built in one place.

Keys are grouped by Redis Cluster hash tag (the text between the first ``{``
and the next ``}``), so that every Lua script touches one slot and the data
spreads over the masters of a Redis Cluster (docs/cluster.md, "Redis
Cluster"; on one Redis the tags change nothing):

- ``rg:{cluster}:…`` -- the *control slot*: membership, heartbeats, votes,
  the generation counter, per-silo directory indexes, stats, events, logs,
  jobs, streams, checkpoint manifests and indexes, the grain-type manifests
  and the state indexes (the dashboard's lists).
- ``rg:{cluster:g:<grain>}:…`` -- one grain's own slot: its directory entry,
  its state heads and chunks (default and named), its checkpoint member
  blobs. The fenced check-and-set (entry token vs writer token, etag, head
  swap) is one script over these keys.
- ``rg:{rgfence-<n>}:<cluster>:fence…`` -- on a Redis Cluster, the fencing
  counter and epoch of one hash slot (``<n>`` is chosen so the tag hashes to
  that slot): a grain's register script increments the counter of the
  grain's own slot. On one Redis (or Sentinel) the whole cluster shares
  ``rg:{cluster}:fence`` as before (one server holds every slot).
- ``rg:{cluster:reminders}:…`` and ``rg:{cluster:leader:<role>}`` --
  reminders and leader leases, each in a slot of their own.

Every key a script touches is passed in ``KEYS``; no script builds a name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot


def warm_slot_tags() -> None:
    """Build the slot -> tag table now (call it off the event loop: ~0.1 s of CPU)."""
    _slot_tags()


@functools.cache
def _slot_tags() -> tuple[str, ...]:
    """For each hash slot, a short hash tag that maps to it (~0.1 s, once per process)."""
    tags: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    left = REDIS_CLUSTER_HASH_SLOTS
    i = 0
    while left:
        tag = f"rgfence-{i:x}"
        slot = key_slot(tag.encode())
        if tags[slot] is None:
            tags[slot] = tag
            left -= 1
        i += 1
    return tuple(t for t in tags if t is not None)


def slot_of(key: str) -> int:
    """The Redis Cluster hash slot of ``key`` (its hash tag's, when it has one)."""
    return int(key_slot(key.encode()))


@dataclass(frozen=True, slots=True)
class Keys:
    cluster: str

    @property
    def prefix(self) -> str:
        """The control slot's prefix (cluster-wide records)."""
        return f"rg:{{{self.cluster}}}:"

    def patterns(self) -> tuple[str, ...]:
        """SCAN ``MATCH`` patterns that together match every key of this cluster."""
        return (self.prefix + "*", f"rg:{{{self.cluster}:*", f"rg:{{rgfence-*}}:{self.cluster}:fence*")

    def grain_prefix(self, grain: str) -> str:
        """The prefix of every key of one grain: the grain's own hash tag, so one slot."""
        return f"rg:{{{self.cluster}:g:{grain}}}:"

    # --- membership --------------------------------------------------------
    @property
    def members(self) -> str:
        """Hash: silo address -> msgpack silo row."""
        return self.prefix + "members"

    @property
    def members_version(self) -> str:
        """Counter bumped on every membership status change."""
        return self.prefix + "members:version"

    @property
    def members_channel(self) -> str:
        """Pub/sub channel told the new version on every status change."""
        return self.prefix + "members:changed"

    @property
    def members_heartbeats(self) -> str:
        """Hash: silo address -> its last heartbeat (a number), read by field by its monitors."""
        return self.prefix + "members:hb"

    @property
    def members_loads(self) -> str:
        """Hash: silo address -> the load JSON its last heartbeat published."""
        return self.prefix + "members:load"

    @property
    def members_feed(self) -> str:
        """Capped stream of membership changes, entry id ``<version>-0``: address and new row."""
        return self.prefix + "members:feed"

    def members_seen(self, silo: str) -> str:
        """Hash (expiring): watched silo -> the heartbeat ``silo``'s failure detector last saw, so
        a detector reads one "moved?" flag a silo and votes on the value kept here."""
        return self.prefix + f"members:seen:{silo}"

    def heartbeat(self, silo: str) -> str:
        """String with a TTL: the silo's last heartbeat time."""
        return self.prefix + f"hb:{silo}"

    def suspicions(self, silo: str) -> str:
        """Hash: voter silo -> time it voted the silo dead."""
        return self.prefix + f"suspect:{silo}"

    def unreachable_votes(self, silo: str) -> str:
        """Hash: voter silo -> Redis time (ms) it last found the silo unreachable over the network."""
        return self.prefix + f"unreach:{silo}"

    @property
    def generation(self) -> str:
        """Counter handing each silo process start a new generation."""
        return self.prefix + "generation"

    # --- directory ---------------------------------------------------------
    def directory_entry(self, grain: str) -> str:
        """Hash: silo, activation, token for one grain id (in the grain's slot)."""
        return self.grain_prefix(grain) + "dir"

    def directory_index(self, silo: str) -> str:
        """Set of grain ids whose directory entry may name this silo (a superset; control slot)."""
        return self.prefix + f"dirindex:{silo}"

    def fencing_counter(self, grain: str | None = None) -> str:
        """Counter of fencing tokens: of the grain's hash slot (Redis Cluster), or of the whole
        cluster (``grain=None``: one Redis, where every key is on one server)."""
        return self._fence_base(grain)

    def fencing_term(self, grain: str | None = None) -> str:
        """Hash: replid (the master's replication id when the epoch was set), epoch; per slot or whole."""
        return self._fence_base(grain) + ":term"

    def _fence_base(self, grain: str | None) -> str:
        if grain is None:
            return self.prefix + "fence"
        tag = _slot_tags()[slot_of(self.directory_entry(grain))]
        return f"rg:{{{tag}}}:{self.cluster}:fence"

    # --- grain types -------------------------------------------------------
    @property
    def grain_manifests(self) -> str:
        """Hash: :func:`manifest_field` (type and version) -> JSON manifest (methods and markers).

        One entry per (type, ``@version``), written by every silo hosting that version, so
        silos of two versions side by side (a rolling upgrade) do not overwrite each other.
        """
        return self.prefix + "manifests"

    # --- state -------------------------------------------------------------
    def state_head(self, grain: str) -> str:
        """Hash: etag, version, chunk count, size of the visible state (in the grain's slot)."""
        return self.grain_prefix(grain) + "state"

    def state_chunk(self, grain: str, version: str, index: int) -> str:
        """String: chunk ``index`` of one version of a big state (the version is its etag)."""
        return chunk_key(self.state_chunk_base(grain), version, index)

    def state_chunk_base(self, grain: str) -> str:
        """Prefix of a state's chunk keys; see :func:`chunk_key`."""
        return self.state_head(grain) + ":v"

    def state_types(self) -> str:
        """Set of grain types that have persisted state (for the dashboard; written after the state)."""
        return self.prefix + "state:types"

    def state_index(self, type_name: str) -> str:
        """Set of keys of one grain type that have persisted state."""
        return self.prefix + f"state:index:{type_name}"

    # Named states (``Grain.named_state``): one head+chunks value per (grain, state name),
    # apart from the default state's keys (the dashboard's index lists only default state).
    # The name is length-prefixed, so no name can make its key look like another's chunk.
    def named_state_head(self, grain: str, name: str) -> str:
        """Hash like ``state_head``: the visible value of the grain's state ``name`` (grain's slot)."""
        return self.grain_prefix(grain) + f"nstate:{len(name)}:{name}"

    def named_state_chunk_base(self, grain: str, name: str) -> str:
        """Prefix of a named state's chunk keys; see :func:`chunk_key`."""
        return self.named_state_head(grain, name) + ":v"

    def named_state_index(self, type_name: str, name: str) -> str:
        """Set of keys of one grain type that have persisted state ``name``."""
        return self.prefix + f"nstate:{name}:index:{type_name}"

    def named_state_types(self, name: str) -> str:
        """Set of grain types that have persisted state ``name``."""
        return self.prefix + f"nstate:{name}:types"

    def checkpoint_index(self, group: str) -> str:
        """Sorted set: complete snapshot ids of a group, scored by their order."""
        return self.prefix + f"ckpt:{group}"

    def checkpoint_pending(self, group: str) -> str:
        """Sorted set: snapshot ids some but not all members have written, scored by order."""
        return self.prefix + f"ckptpending:{group}"

    @property
    def checkpoint_groups(self) -> str:
        """Set of checkpoint group names (for listing and the dashboard)."""
        return self.prefix + "ckptgroups"

    def checkpoint_manifest(self, group: str, snapshot: str) -> str:
        """Hash: members (JSON list), order, keep, status, created, completed, w:{member} flags."""
        return self.prefix + f"ckpt:{group}:{snapshot}"

    def checkpoint_member(self, group: str, snapshot: str, member: str) -> str:
        """Hash like ``state_head``: one member's saved state in one snapshot (the member grain's slot)."""
        return self.grain_prefix(member) + f"ckpt:{group}:{snapshot}"

    def checkpoint_chunk_base(self, group: str, snapshot: str, member: str) -> str:
        """Prefix of a member's chunk keys; see :func:`chunk_key`."""
        return self.checkpoint_member(group, snapshot, member) + ":v"

    # --- reminders ---------------------------------------------------------
    # A slot of their own: the reminder scripts touch only these three keys.
    @property
    def reminders(self) -> str:
        """Sorted set: reminder id scored by its next due time."""
        return f"rg:{{{self.cluster}:reminders}}:due"

    @property
    def reminder_rows(self) -> str:
        """Hash: reminder id (JSON [type, key, name]) -> JSON row (type, key, name, period_ms)."""
        return f"rg:{{{self.cluster}:reminders}}:rows"

    @property
    def reminder_fired(self) -> str:
        """Hash: reminder id -> JSON {at (unix s), silo} of its last delivered tick."""
        return f"rg:{{{self.cluster}:reminders}}:fired"

    # --- cluster services --------------------------------------------------
    def leader(self, role: str) -> str:
        """String with a TTL: which silo holds a cluster-wide role (rebalancer); a slot of its own."""
        return f"rg:{{{self.cluster}:leader:{role}}}"

    def silo_stats(self, silo: str) -> str:
        """String with a TTL: the silo's latest published stats record."""
        return self.prefix + f"stats:{silo}"

    @property
    def silo_stats_index(self) -> str:
        """Sorted set: silo address scored by the time of its last stats record."""
        return self.prefix + "stats:index"

    def silo_stats_history(self, silo: str) -> str:
        """Capped list (newest first) with a TTL: the silo's recent load points."""
        return self.prefix + f"stats:{silo}:history"

    @property
    def events(self) -> str:
        """Capped stream of cluster events (joins, deaths, moves)."""
        return self.prefix + "events"

    @property
    def logs(self) -> str:
        """Capped stream of silos' log records (time, level, logger, message, silo, exc)."""
        return self.prefix + "logs"

    @property
    def jobs(self) -> str:
        """Set of training job ids."""
        return self.prefix + "jobs"

    def job_progress(self, job: str) -> str:
        """String: latest training progress record of one job."""
        return self.prefix + f"job:{job}:progress"

    def job_history(self, job: str) -> str:
        """Capped stream of a job's per-step metrics (for curves)."""
        return self.prefix + f"job:{job}:history"

    def job_cancel(self, job: str) -> str:
        """String with a TTL: set when an admin asked to cancel the job (the coordinator reads it)."""
        return self.prefix + f"job:{job}:cancel"

    def rendezvous(self, job: str, generation: int) -> str:
        """Prefix for torch.distributed store keys of one group generation."""
        return self.prefix + f"rdzv:{job}:{generation}:"

    def rendezvous_pattern(self, job: str) -> str:
        """SCAN pattern matching every rendezvous key of ``job`` (all generations)."""
        return self.prefix + f"rdzv:{job}:*"

    def control(self, silo: str) -> str:
        """List: admin commands for one silo (drain)."""
        return self.prefix + f"control:{silo}"

    def control_channel(self, silo: str) -> str:
        """Pub/sub channel: a command was pushed onto :meth:`control` (wakes the silo's inbox)."""
        return self.prefix + f"control-wake:{silo}"

    # --- streams (silo/streams/) ---------------------------------------------
    # Names are unambiguous: a namespace has no ':' and a grain type name no '/'. Today every
    # key shares the cluster's hash tag; a move to per-stream tags for Redis Cluster would tag
    # ``{namespace:key}`` in both names below, so a stream and its leases stay in one slot.
    # The namespace sets are cluster-wide and only ever written beside a stream in a pipeline,
    # never in one script with it.
    def stream(self, namespace: str, key: str) -> str:
        """Stream: the items of stream ``(namespace, key)``, field ``v`` = codec blob; entry id = token."""
        return self.prefix + f"stream:{namespace}:{key}"

    def stream_lease(self, namespace: str, key: str, group: str) -> str:
        """String with a TTL: the silo delivering this stream to consumer group ``group`` (a grain type)."""
        return self.prefix + f"stream-lease:{namespace}:{group}/{key}"

    @property
    def stream_namespaces(self) -> str:
        """Set of stream namespaces anyone published to (the dashboard's list)."""
        return self.prefix + "streams"

    def stream_keys(self, namespace: str) -> str:
        """Set of the stream keys of one namespace (how silos find keys to deliver)."""
        return self.prefix + f"streams:{namespace}"

    @property
    def stream_retention_lock(self) -> str:
        """String with a TTL: the silo sweeping streams by age this interval (silo/streams/retention.py)."""
        return self.prefix + "stream-retention"

    def stream_dead_letters(self, namespace: str) -> str:
        """Capped stream of the items of one namespace that no ``@subscribes`` turn took (fields
        ``key``, ``group``, ``token``, ``v`` = the item's blob, ``error``, ``traceback``, ``attempts``, ``silo``)."""
        return self.prefix + f"stream-dead:{namespace}"



def chunk_key(base: str, version: str, index: int) -> str:
    """A chunk of a head+chunks value (state, checkpoint member); scripts get these in KEYS."""
    return f"{base}{version}:{index}"


def manifest_field(type_name: str, version: int) -> str:
    """The field of one version of a grain type in ``Keys.grain_manifests``."""
    return f"{type_name}@{version}"


def parse_manifest_field(field: str | bytes) -> tuple[str, int]:
    """``(type name, version)`` of a ``grain_manifests`` field; ValueError if it is not one."""
    text = field.decode() if isinstance(field, bytes) else field
    name, sep, version = text.rpartition("@")
    if not sep or not name:
        raise ValueError(f"not a grain manifest field: {text!r}")
    return name, int(version)
