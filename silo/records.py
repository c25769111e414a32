"""What silos publish to Redis for everyone else to read: one module, no torch.

The dashboard, the ``redgrain`` command and other silos read the cluster only
through these records (and the keys they live under, ``silo/keys.py``):

* membership rows (``keys.members``): address, generation, status, roles,
  load; written by the membership table's Lua scripts;
* silo stats (``keys.silo_stats``): one JSON record per silo per second, with
  every component's ``statistics()`` and per-method counters whose latency
  histograms share fixed buckets, so readers can add them up across silos;
* cluster events (``keys.events``): joins, deaths, drains, rebalances;
* control requests (``keys.control``, ``keys.job_cancel``): drain a silo,
  cancel a job. :func:`request_drain` and :func:`request_cancel` are the only
  writers, shared by the CLI and the dashboard.

Workloads publish their own records through the public grain API
(``Grain.publish_progress``); their schemas live with the workload
(``grains/training/api/records.py``).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from pydantic import BaseModel, Field, field_validator

from grains.ids import SiloAddress
from silo import errors
from silo.keys import Keys
from silo.redis_util import redis_errors

log = logging.getLogger("redgrain.records")

# --- membership ---------------------------------------------------------------

class SiloStatus(str, enum.Enum):
    JOINING = "Joining"
    ACTIVE = "Active"
    SHUTTING_DOWN = "ShuttingDown"
    DEAD = "Dead"


LIVE = (SiloStatus.JOINING, SiloStatus.ACTIVE, SiloStatus.SHUTTING_DOWN)


class SiloLoad(BaseModel):
    """Load a silo publishes with each heartbeat, for resource-optimized placement."""

    cpu_percent: float = 0.0
    memory_percent: float = 0.0
    activations: int = 0
    memory_available_bytes: int = 0
    """Host memory available to new allocations (psutil's ``available``); 0: not reported."""


class MemberRow(BaseModel):
    address: str
    host: str
    port: int
    generation: int
    status: SiloStatus = SiloStatus.JOINING
    roles: list[str] = Field(default_factory=list)
    grain_types: list[str] = Field(default_factory=list)
    grain_versions: dict[str, int] = Field(default_factory=dict)
    """Grain type -> the ``@version`` this silo hosts (a type missing here: version 1)."""
    started: float = 0.0
    heartbeat: float = 0.0
    pid: int = 0
    hostname: str = ""
    load: SiloLoad = Field(default_factory=SiloLoad)

    @field_validator("roles", "grain_types", mode="before")
    @classmethod
    def _empty_lua_table(cls, v: Any) -> Any:
        # Lua's cjson cannot tell an empty array from an empty object: {} means [].
        return [] if v == {} else v

    @field_validator("grain_versions", mode="before")
    @classmethod
    def _empty_lua_object(cls, v: Any) -> Any:
        return {} if v == [] else v  # the other way round: cjson may write {} as []

    @property
    def silo(self) -> SiloAddress:
        return SiloAddress(self.host, self.port, self.generation)

    def version_of(self, type_name: str) -> int:
        """The version of ``type_name`` this silo hosts (1 for a class without ``@version``)."""
        return self.grain_versions.get(type_name, 1)


def merge_row(row: MemberRow, heartbeat: Any, load: Any) -> MemberRow:
    """A row with its heartbeat and load (kept in hashes of their own, ``Keys.members_heartbeats``
    and ``Keys.members_loads``, so a heartbeat never rewrites the row) filled in."""
    update: dict[str, Any] = {}
    if heartbeat is not None:
        update["heartbeat"] = float(heartbeat)
    if load is not None:
        try:
            update["load"] = SiloLoad.model_validate_json(load)
        except ValueError:
            pass
    return row.model_copy(update=update) if update else row


# --- silo stats -----------------------------------------------------------------
#
# Silos write one small JSON record a second; the dashboard reads only these,
# so it never adds work to a call path. Histograms travel sparse ({bucket
# index: count}) because most of the 37 buckets of a method are empty.

# Upper bounds in milliseconds: 0.05 ms .. ~100 s, 4 buckets per doubling-ish.
BUCKETS_MS: tuple[float, ...] = tuple(round(0.05 * 1.5**i, 4) for i in range(36))


def percentile(histogram: list[int] | tuple[int, ...], q: float) -> float:
    """The bucket bound under which a fraction ``q`` of calls finished (ms)."""
    total = sum(histogram)
    if total == 0:
        return 0.0
    rank = q * total
    seen = 0
    for i, n in enumerate(histogram):
        seen += n
        if seen >= rank:
            return BUCKETS_MS[i] if i < len(BUCKETS_MS) else BUCKETS_MS[-1] * 1.5
    return BUCKETS_MS[-1] * 1.5


STATS_TTL_FACTOR = 5
"""A stats record expires after this many publish intervals (a dead silo's fades)."""
HISTORY_POINTS = 300
"""Load points kept per silo (5 minutes at the default interval)."""
WINDOW_S = 10.0
"""Span of the 'recent' rates and latency histograms."""


class MethodRecord(BaseModel):
    """One method's counters in a silo's record."""

    grain_type: str
    method: str
    calls: int = Field(description="Calls completed since the silo started.")
    errors: int = Field(description="Calls that raised since the silo started.")
    total_ms: float = Field(description="Sum of call durations since start.")
    hist: dict[int, int] = Field(
        default_factory=dict, description="Sparse BUCKETS_MS histogram since start."
    )
    window_calls: int = Field(default=0, description="Calls completed in the last window_s.")
    window_errors: int = Field(default=0, description="Calls that raised in the last window_s.")
    window_hist: dict[int, int] = Field(
        default_factory=dict, description="Sparse histogram of the last window_s."
    )


class LoadPoint(BaseModel):
    """One point of a silo's load history."""

    at: float
    cpu_percent: float
    rss_bytes: int
    activations: int
    calls_per_s: float


class GpuRecord(BaseModel):
    """One GPU as a silo sees it, in its stats record (absent when the silo has no GPU)."""

    index: int = Field(description="Device index (NVML's, or CUDA's under torch's figures).")
    name: str = ""
    source: str = Field(description="Where the figures come from: 'nvml' (the whole device) or 'torch'.")
    utilization: float | None = Field(
        default=None, description="Busy fraction of the last sample period, 0..1 (None: unknown, e.g. torch)."
    )
    memory_used_bytes: int = Field(description="Device memory in use (all processes; torch: total - free).")
    memory_total_bytes: int


class SiloStatsRecord(BaseModel):
    """What a silo publishes each interval under ``keys.silo_stats(address)``."""

    address: str
    status: str = Field(description="The silo object's own status: active, stopping, ...")
    at: float = Field(description="Publish time (unix seconds).")
    started: float
    uptime_s: float
    pid: int
    cpu_percent: float = Field(description="Process CPU since the last record (100 = one core).")
    rss_bytes: int
    memory_percent: float
    activations: int
    by_type: dict[str, int] = Field(
        default_factory=dict, description="Live activations per grain type."
    )
    keys_sample: dict[str, list[str]] = Field(
        default_factory=dict, description="Some live keys per type."
    )
    window_s: float = Field(description="Span the window_* counters of the methods cover.")
    methods: list[MethodRecord] = Field(default_factory=list)
    components: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Every other component's statistics(), as plain fields."
    )
    gpus: list[GpuRecord] = Field(
        default_factory=list,
        description="The GPUs this silo uses (NVML, else torch's CUDA figures); empty without one. "
        "Records from before this field parse with none.",
    )


def dense(sparse: dict[int, int]) -> list[int]:
    """A sparse histogram back to one count per bucket of BUCKETS_MS (+ overflow)."""
    out = [0] * (len(BUCKETS_MS) + 1)
    for i, n in sparse.items():
        if 0 <= int(i) < len(out):
            out[int(i)] += n
    return out


# --- cluster events -------------------------------------------------------------

class ClusterEvent(BaseModel):
    """One entry of the event stream."""

    id: str = Field(default="", description="Stream entry id (milliseconds-sequence).")
    at: float = Field(description="Unix time the event was emitted.")
    kind: str
    silo: str = Field(default="", description="Who emitted it (a silo address, 'dashboard', ...).")
    data: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_entry(cls, entry_id: Any, fields: dict[Any, Any]) -> ClusterEvent:
        def text(v: Any) -> str:
            return v.decode(errors="replace") if isinstance(v, bytes) else str(v)

        f = {text(k): text(v) for k, v in fields.items()}
        try:
            data = json.loads(f.get("data", "{}"))
        except ValueError:
            data = {"raw": f.get("data", "")}
        try:
            at = float(f.get("at", "0"))
        except ValueError:
            at = 0.0
        return cls(id=text(entry_id), at=at, kind=f.get("kind", "?"), silo=f.get("silo", ""),
                   data=data if isinstance(data, dict) else {"value": data})  # fmt: skip


async def read_events(
    redis: aioredis.Redis, keys: Keys, *, count: int = 200, before: str | None = None
) -> list[ClusterEvent]:
    """The newest ``count`` events (newest first), optionally older than stream id ``before``."""
    with redis_errors("read events"):
        entries = await redis.xrevrange(
            keys.events, max=f"({before}" if before else "+", min="-", count=count
        )
    return [ClusterEvent.from_entry(i, f or {}) for i, f in entries or []]


# --- the event log writer ---------------------------------------------------------
#
# Any component that sees something worth a line in the dashboard's event log
# calls ``events.emit(kind, **data)``: it returns at once and the XADD runs in
# the background, so a hook on a hot path (a membership change, a move) never
# waits on Redis. ``await events.write(kind, **data)`` does the same and waits.
# The stream ``keys.events`` keeps about the last 10,000 events (MAXLEN ~).
# Kinds in use: join, leave, suspect, dead, rebalance, failover, drain, cancel.

EVENTS_MAXLEN = 10_000
_MAX_PENDING = 1000  # unwritten events kept (Redis slow or down); the oldest go first


@dataclass(frozen=True, slots=True)
class EventLogStatistics:
    written: int
    """Events written to the stream."""
    dropped: int
    """Events lost because Redis was unreachable or too many were pending."""
    pending: int
    """Events emitted and waiting to be written."""


class EventLog:
    """Writes cluster events to ``keys.events``; ``emit`` is the hook other components call.

    Emitted events wait in a bounded queue that one background task drains,
    in order, a pipelined batch at a time.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        source: str,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._source = source
        self._clock = clock
        self._queue: deque[dict[Any, Any]] = deque()
        self._writer: asyncio.Task[None] | None = None
        self._written = self._dropped = 0

    def _fields(self, kind: str, data: dict[str, Any]) -> dict[Any, Any]:
        return {
            "at": repr(self._clock()),
            "kind": kind,
            "silo": self._source,
            "data": json.dumps(data, default=str),
        }

    def emit(self, kind: str, **data: Any) -> None:
        """Record an event without waiting (safe from sync callbacks inside the event loop)."""
        if len(self._queue) >= _MAX_PENDING:
            self._queue.popleft()  # keep the newest: they say what the cluster is doing now
            self._dropped += 1
        self._queue.append(self._fields(kind, data))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(
                self._drain(), name="events-writer"
            )

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        """``emit`` with the data as one dict, for components that take an ``on_event`` hook."""
        self.emit(kind, **data)

    async def write(self, kind: str, **data: Any) -> str:
        """Record an event and wait for Redis; returns the stream id. Raises StorageError."""
        with redis_errors(f"write {kind} event"):
            entry = await self._redis.xadd(
                self._keys.events, self._fields(kind, data), maxlen=EVENTS_MAXLEN, approximate=True
            )
        self._written += 1
        return entry.decode() if isinstance(entry, bytes) else str(entry)

    async def _drain(self) -> None:
        while self._queue:
            batch = [self._queue.popleft() for _ in range(min(len(self._queue), 100))]
            try:
                with redis_errors("write events"):
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for fields in batch:
                            pipe.xadd(
                                self._keys.events, fields, maxlen=EVENTS_MAXLEN, approximate=True
                            )
                        await pipe.execute()
                self._written += len(batch)
            except errors.StorageError as exc:
                self._dropped += len(batch)
                log.debug("%d events not recorded: %s", len(batch), exc)

    async def flush(self) -> None:
        """Wait until every emitted event is written (or dropped)."""
        while self._writer is not None and not self._writer.done():
            await asyncio.wait({self._writer})  # never raises, even if the writer was cancelled

    def cancel_pending(self) -> None:
        """Drop unwritten events (a silo declared dead touches nothing in Redis)."""
        self._dropped += len(self._queue)
        self._queue.clear()
        if self._writer is not None:
            self._writer.cancel()

    def statistics(self) -> EventLogStatistics:
        return EventLogStatistics(self._written, self._dropped, len(self._queue))


# --- workload progress ---------------------------------------------------------------

JOB_HISTORY_MAXLEN = 10_000
"""History points kept per job (a capped stream: curves over the last 10k steps)."""


async def publish_progress(
    redis: aioredis.Redis,
    keys: Keys,
    job: str,
    record: str,
    point: Mapping[str, str] | Sequence[Mapping[str, str]] | None,
    *,
    restart: bool = False,
) -> bool:
    """Publish a job's latest record (JSON) and history points; True if a cancel was asked.

    One pipelined round trip: SET the record under ``keys.job_progress``, XADD
    the point (or points, in order) to the capped ``keys.job_history`` stream, SADD the job to
    ``keys.jobs``, and read the cancel flag :func:`request_cancel` sets. The
    record's schema is the workload's (``grains/training/api/records.py``).
    ``restart``: the stream is deleted first, so it holds these points alone (the job's
    history lost points: a stream is append-only).
    """
    points = [point] if isinstance(point, Mapping) else list(point or ())
    with redis_errors(f"publish progress of job {job}"):
        async with redis.pipeline(transaction=restart) as pipe:
            pipe.set(keys.job_progress(job), record)
            if restart:
                pipe.delete(keys.job_history(job))
            for p in points:
                if p:
                    pipe.xadd(keys.job_history(job), dict(p), maxlen=JOB_HISTORY_MAXLEN, approximate=True)  # type: ignore[arg-type]
            pipe.sadd(keys.jobs, job)
            pipe.exists(keys.job_cancel(job))
            result = await pipe.execute()
    return bool(result[-1])


async def forget_progress(redis: aioredis.Redis, keys: Keys, job: str) -> int:
    """Delete what :func:`publish_progress` and a job's rendezvous wrote for ``job``: its record,
    history, cancel flag, its rendezvous keys, and its entry in ``keys.jobs``. Returns keys deleted."""
    with redis_errors(f"forget progress of job {job}"):
        doomed = [keys.job_progress(job), keys.job_history(job), keys.job_cancel(job)]
        doomed += [k async for k in redis.scan_iter(match=keys.rendezvous_pattern(job), count=500)]
        async with redis.pipeline(transaction=True) as pipe:
            pipe.delete(*doomed)
            pipe.srem(keys.jobs, job)
            deleted, _ = await pipe.execute()
    return int(deleted)


# --- control requests -------------------------------------------------------------

CONTROL_TTL_S = 3600
"""How long an unread control request waits for its silo (a busy or restarting one)."""
CANCEL_TTL_S = 7 * 24 * 3600
"""How long a cancel request stands (a job may be paused for days)."""


class ControlRequest(BaseModel):
    """One admin command in a silo's control list (``keys.control(silo)``)."""

    command: str = Field(description="What to do: 'drain'.")
    at: float = Field(default_factory=time.time, description="When it was asked (unix seconds).")
    by: str = Field(default="", description="Who asked: 'dashboard', 'redgrain drain', ...")


async def request_drain(redis: aioredis.Redis, keys: Keys, address: str, *, by: str) -> None:
    """Ask silo ``address`` to drain itself (hand its activations off, then stop)."""
    body = ControlRequest(command="drain", by=by).model_dump_json()
    with redis_errors("send drain"):
        async with redis.pipeline(transaction=True) as pipe:
            pipe.rpush(keys.control(address), body)
            pipe.expire(keys.control(address), CONTROL_TTL_S)
            await pipe.execute()
        # Outside the transaction: a channel has no slot on a Redis Cluster. A lost message only
        # delays the command to the inbox's next poll (silo/cluster/control.py).
        await redis.publish(keys.control_channel(address), "1")


async def request_cancel(redis: aioredis.Redis, keys: Keys, job: str, reason: str = "") -> None:
    """Ask a job's owner to cancel it; the owner sees it on its next progress publish."""
    with redis_errors(f"cancel job {job}"):
        await redis.set(keys.job_cancel(job), reason or "cancel", ex=CANCEL_TTL_S)


# --- reminders and live logs (the dashboard's pages) ------------------------------


class ReminderInfo(BaseModel):
    """One registered reminder, as the dashboard shows it (silo/cluster/reminders.py writes the keys)."""

    type: str = Field(description="Grain type.")
    key: str = Field(description="Grain key.")
    name: str
    period_s: float
    next_due: float | None = Field(
        default=None, description="When the next tick is due (unix seconds, Redis clock)."
    )
    last_fired: float | None = Field(
        default=None, description="When its last delivered tick ran (unix seconds, Redis clock)."
    )
    last_silo: str | None = Field(default=None, description="The silo that tick's turn ran on.")


async def read_reminders(
    redis: aioredis.Redis, keys: Keys, type_name: str | None = None
) -> list[ReminderInfo]:
    """Every reminder of the cluster (or of one grain type), by type, key and name."""
    with redis_errors("read reminders"):
        async with redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.reminder_rows)
            pipe.zrange(keys.reminders, 0, -1, withscores=True)
            pipe.hgetall(keys.reminder_fired)
            rows, due, fired = await pipe.execute()
    due_at = {_text(rid): score / 1000.0 for rid, score in due}
    last = {_text(rid): raw for rid, raw in fired.items()}
    out = []
    for rid_raw, raw in rows.items():
        rid = _text(rid_raw)
        try:
            row = json.loads(raw)
            info = ReminderInfo(type=row["type"], key=row["key"], name=row["name"],
                                period_s=row["period_ms"] / 1000.0, next_due=due_at.get(rid))  # fmt: skip
            if rid in last:
                tick = json.loads(last[rid])
                info = info.model_copy(update={"last_fired": float(tick["at"]), "last_silo": str(tick["silo"])})
        except (ValueError, KeyError, TypeError):
            continue  # a row from another version: not ours to show
        if type_name is None or info.type == type_name:
            out.append(info)
    return sorted(out, key=lambda r: (r.type, r.key, r.name))


class StreamConsumerInfo(BaseModel):
    """One consumer (a silo) of a stream's consumer group."""

    name: str = Field(description="The consuming silo's address.")
    pending: int = Field(description="Items it read and has not acknowledged yet.")
    idle_ms: int = Field(description="Since it last read or claimed from this stream.")


class StreamGroupInfo(BaseModel):
    """One implicit subscription of a stream: the consumer group of a ``@subscribes`` grain type."""

    name: str = Field(description="The subscribing grain type (the group's name).")
    lag: int | None = Field(
        default=None, description="Items not yet read by the group (None: Redis cannot tell after trimming)."
    )
    pending: int = Field(description="Items read, not yet acknowledged (their turns running, or to redo).")
    last_delivered: str = Field(description="Token of the last item the group read.")
    holder: str | None = Field(default=None, description="The silo delivering this key now (its lease).")
    consumers: list[StreamConsumerInfo] = Field(default_factory=list)


class StreamInfo(BaseModel):
    """One stream, ``(namespace, key)``, as silo/streams/ keeps it in Redis."""

    namespace: str
    key: str
    length: int = Field(description="Items kept (after trimming).")
    first_token: str | None = None
    last_token: str | None = Field(default=None, description="Token of the newest item.")
    groups: list[StreamGroupInfo] = Field(default_factory=list)


async def read_streams(
    redis: aioredis.Redis, keys: Keys, namespace: str | None = None, limit: int = 200
) -> tuple[list[StreamInfo], list[str], bool]:
    """Streams (of one namespace, or all), their groups, consumers and lag; at most ``limit``
    streams, by namespace and key. Returns (streams, every namespace, whether some were left out)."""
    with redis_errors("read streams"):
        namespaces = sorted(_text(n) for n in await redis.smembers(keys.stream_namespaces))
        wanted = [n for n in namespaces if namespace is None or n == namespace]
        names: list[tuple[str, str]] = []
        for ns in wanted:
            names.extend((ns, _text(k)) for k in await redis.smembers(keys.stream_keys(ns)))
        names.sort()
        truncated = len(names) > limit
        names = names[:limit]
        async with redis.pipeline(transaction=False) as pipe:
            for ns, key in names:
                pipe.xinfo_stream(keys.stream(ns, key))
                pipe.xinfo_groups(keys.stream(ns, key))
            replies = await pipe.execute(raise_on_error=False)
        out: list[StreamInfo] = []
        consumers_of: list[tuple[StreamGroupInfo, str, str]] = []
        for i, (ns, key) in enumerate(names):
            info, groups = replies[2 * i], replies[2 * i + 1]
            if isinstance(info, Exception):  # listed, but gone (deleted by hand)
                info, groups = {"length": 0}, []
            first, last = info.get("first-entry"), info.get("last-entry")
            stream = StreamInfo(
                namespace=ns, key=key, length=int(info.get("length", 0)),
                first_token=_text(first[0]) if first else None,
                last_token=_text(last[0]) if last else None,
            )  # fmt: skip
            for g in groups if isinstance(groups, list) else ():
                group = StreamGroupInfo(
                    name=_text(g["name"]), pending=int(g["pending"]),
                    lag=None if g.get("lag") is None else int(g["lag"]),
                    last_delivered=_text(g.get("last-delivered-id", "")),
                )  # fmt: skip
                stream.groups.append(group)
                consumers_of.append((group, ns, key))
            out.append(stream)
        if consumers_of:
            async with redis.pipeline(transaction=False) as pipe:
                for group, ns, key in consumers_of:
                    pipe.xinfo_consumers(keys.stream(ns, key), group.name)
                    pipe.get(keys.stream_lease(ns, key, group.name))
                replies = await pipe.execute(raise_on_error=False)
            for i, (group, _, _) in enumerate(consumers_of):
                consumers, holder = replies[2 * i], replies[2 * i + 1]
                group.holder = None if holder is None or isinstance(holder, Exception) else _text(holder)
                for c in consumers if isinstance(consumers, list) else ():
                    group.consumers.append(
                        StreamConsumerInfo(name=_text(c["name"]), pending=int(c["pending"]), idle_ms=int(c["idle"]))
                    )
    return out, namespaces, truncated


class DeadLetter(BaseModel):
    """One item no ``@subscribes`` turn took (``keys.stream_dead_letters``, written by silo/streams/agent.py)."""

    id: str = Field(description="The dead letter's own entry id (when it was written).")
    key: str = Field(description="The stream key the item was published to.")
    group: str = Field(description="The subscribing grain type that did not take it.")
    token: str = Field(description="The item's token in its stream.")
    error: str = Field(description="The last attempt's failure.")
    attempts: int = Field(description="Attempts made (0: the item could not be decoded).")
    silo: str = Field(description="The silo that gave up on it.")


class DeadLetters(BaseModel):
    """The dead-letter stream of one namespace: how many it keeps, and the newest."""

    namespace: str
    count: int = Field(description="Dead letters kept (the stream is capped at streams.dead_letter_maxlen).")
    newest: list[DeadLetter] = Field(default_factory=list, description="Newest first.")


async def read_dead_letters(
    redis: aioredis.Redis, keys: Keys, namespaces: list[str], newest: int = 10
) -> list[DeadLetters]:
    """The dead letters of each namespace that has any: the count and the ``newest`` few."""
    with redis_errors("read stream dead letters"):
        async with redis.pipeline(transaction=False) as pipe:
            for ns in namespaces:
                pipe.xlen(keys.stream_dead_letters(ns))
                pipe.xrevrange(keys.stream_dead_letters(ns), count=newest)
            replies = await pipe.execute()
    out = []
    for i, ns in enumerate(namespaces):
        count, entries = int(replies[2 * i]), replies[2 * i + 1]
        if not count:
            continue
        letters = []
        for entry_id, raw in entries:
            f = {_text(k): _text(v) for k, v in raw.items() if k not in (b"v", "v")}
            try:
                letters.append(DeadLetter(
                    id=_text(entry_id), key=f["key"], group=f["group"], token=f["token"],
                    error=f.get("error", ""), attempts=int(f.get("attempts", 0)), silo=f.get("silo", ""),
                ))  # fmt: skip
            except (KeyError, ValueError):
                continue  # an entry from another version: not ours to show
        out.append(DeadLetters(namespace=ns, count=count, newest=letters))
    return out


LOG_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}


class LogEntry(BaseModel):
    """One record of the log stream (``keys.logs``, written by silo/logstream.py)."""

    id: str = Field(description="Stream entry id (milliseconds-sequence); pass it as `since` to tail.")
    time: float = Field(description="When it was logged (unix seconds, the silo's clock).")
    level: str
    logger: str
    message: str
    silo: str = Field(description="The silo whose work logged it.")
    exc: str = Field(default="", description="Formatted exception (traceback), if any.")

    @classmethod
    def from_entry(cls, entry_id: Any, fields: dict[Any, Any]) -> LogEntry:
        f = {_text(k): _text(v) for k, v in fields.items()}
        try:
            at = float(f.get("time", "0"))
        except ValueError:
            at = 0.0
        return cls(id=_text(entry_id), time=at, level=f.get("level", "?"), logger=f.get("logger", ""),
                   message=f.get("message", ""), silo=f.get("silo", ""), exc=f.get("exc", ""))  # fmt: skip


_LOG_SCAN_MAX = 20_000
"""Entries one read looks through at most to find ``limit`` that match its filters."""


async def read_logs(
    redis: aioredis.Redis,
    keys: Keys,
    *,
    since: str | None = None,
    silo: str | None = None,
    level: str | None = None,
    limit: int = 200,
) -> tuple[list[LogEntry], str | None]:
    """Log records, oldest first, and the id of the last entry looked at (the next ``since``).

    ``since`` is a stream id (entries after it) or unix milliseconds (entries
    from then on). With it, the oldest ``limit`` matching entries after it
    come back, so a tail that passes the returned id misses nothing; without
    it, the newest ``limit``. ``level`` keeps that level and above.
    """
    floor = 0
    if level is not None:
        if level.upper() not in LOG_LEVELS:
            raise errors.ConfigError(f"unknown log level {level!r}; one of {', '.join(LOG_LEVELS)}")
        floor = LOG_LEVELS[level.upper()]

    def keep(e: LogEntry) -> bool:
        return (silo is None or e.silo == silo) and LOG_LEVELS.get(e.level, 0) >= floor

    found: list[LogEntry] = []
    last: str | None = since if since and "-" in since else None
    chunk = max(limit, 100)
    scanned = 0
    with redis_errors("read logs"):
        if since:
            cursor = f"({since}" if "-" in since else since
            while len(found) < limit and scanned < _LOG_SCAN_MAX:
                entries = await redis.xrange(keys.logs, min=cursor, max="+", count=chunk) or []
                for i, f in entries:
                    last = _text(i)
                    e = LogEntry.from_entry(i, f or {})
                    if keep(e):
                        found.append(e)
                        if len(found) == limit:
                            break
                scanned += len(entries)
                if len(entries) < chunk:
                    break
                cursor = f"({last}"
            return found, last
        top = "+"
        while len(found) < limit and scanned < _LOG_SCAN_MAX:
            entries = await redis.xrevrange(keys.logs, max=top, min="-", count=chunk) or []
            for i, f in entries:
                if last is None:
                    last = _text(i)  # the newest entry: a tail goes on from there
                e = LogEntry.from_entry(i, f or {})
                if keep(e):
                    found.append(e)
                    if len(found) == limit:
                        break
            scanned += len(entries)
            if len(entries) < chunk:
                break
            top = f"({_text(entries[-1][0])}"
    found.reverse()
    return found, last


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)
