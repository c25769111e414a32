"""The dashboard's JSON API, as pydantic models (they are the OpenAPI schema at /docs).

The records silos and the coordinator publish (``SiloStatsRecord``,
``JobProgress``, ``JobPoint``, ``ClusterEvent``) are defined next to their
writers in ``silo/``; they are re-exported here because the API returns them
as they are.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from grains.training.api.records import (
    CheckpointInfo,
    JobPoint,
    JobProgress,
    Placement,
    RecoveryInfo,
)
from silo.records.events import ClusterEvent
from silo.records.logs import LogEntry
from silo.records.reminders import ReminderInfo
from silo.records.stats import LoadPoint, SiloStatsRecord
from silo.records.streams import DeadLetter, DeadLetters, StreamInfo

__all__ = [
    "AdminResult",
    "CheckpointInfo",
    "ClusterEvent",
    "Config",
    "DeadLetter",
    "DeadLetters",
    "EventList",
    "GrainKeys",
    "GrainState",
    "Grains",
    "GrainsBySiloRow",
    "GrainsByTypeRow",
    "JobDetail",
    "JobList",
    "JobPoint",
    "JobProgress",
    "LoadPoint",
    "LogEntry",
    "LogList",
    "MethodRow",
    "Methods",
    "Overview",
    "Placement",
    "RecoveryInfo",
    "RedisStatus",
    "ReminderInfo",
    "ReminderList",
    "SiloDetail",
    "SiloList",
    "SiloStatsRecord",
    "SiloSummary",
    "StreamInfo",
    "StreamList",
]


class RedisStatus(BaseModel):
    ok: bool = Field(description="Whether the last read from Redis worked.")
    error: str | None = Field(default=None, description="Why not, when it did not.")
    latency_ms: float | None = Field(default=None, description="Round trip of the last read.")


class Config(BaseModel):
    cluster: str
    admin: bool = Field(description="Whether admin actions are enabled (a token is configured).")
    poll_ms: int = Field(description="How often the page refreshes.")


class Overview(BaseModel):
    cluster: str
    at: float = Field(description="When this snapshot was read (unix seconds).")
    redis: RedisStatus
    silos: dict[str, int] = Field(
        default_factory=dict, description="Silo count per membership status."
    )
    silos_live: int = Field(default=0, description="Silos Joining, Active or ShuttingDown.")
    activations: int = 0
    calls_total: int = Field(
        default=0, description="Calls completed by live silos since they started."
    )
    errors_total: int = 0
    calls_per_s: float = Field(default=0.0, description="Over the silos' last window (about 10 s).")
    errors_per_s: float = 0.0
    p50_ms: float = Field(
        default=0.0,
        description="Median call latency, cluster-wide, last window (else since start).",
    )
    p99_ms: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    jobs: int = Field(default=0, description="Training jobs known.")
    message: str | None = Field(
        default=None, description="A plain sentence when there is nothing to show."
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="Conditions an operator should act on now, one sentence each (e.g. a Redis master "
        "without the replicas wait_replicas asks for: writes there are acknowledged unreplicated).",
    )


class SiloSummary(BaseModel):
    address: str
    status: str = Field(description="Membership status: Joining, Active, ShuttingDown or Dead.")
    roles: list[str] = Field(default_factory=list)
    hostname: str = ""
    pid: int = 0
    started: float = 0.0
    uptime_s: float = 0.0
    heartbeat_age_s: float | None = Field(
        default=None, description="Seconds since the silo's last heartbeat."
    )
    published: bool = Field(description="Whether a fresh stats record exists for this silo.")
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    memory_percent: float = 0.0
    activations: int = 0
    calls_total: int = 0
    errors_total: int = 0
    calls_per_s: float = 0.0
    errors_per_s: float = 0.0
    frames_in: int = 0
    frames_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    connections: int = 0
    grain_types: list[str] = Field(default_factory=list)


class SiloList(BaseModel):
    redis: RedisStatus
    silos: list[SiloSummary]


class SiloDetail(BaseModel):
    silo: SiloSummary
    by_type: dict[str, int] = Field(default_factory=dict)
    history: list[LoadPoint] = Field(default_factory=list, description="Oldest first.")
    components: dict[str, dict[str, Any]] = Field(default_factory=dict)


class GrainsByTypeRow(BaseModel):
    type: str
    activations: int
    by_silo: dict[str, int]
    persisted: bool = Field(description="Whether any grain of this type has persisted state.")


class GrainsBySiloRow(BaseModel):
    silo: str
    status: str
    activations: int
    by_type: dict[str, int]


class Grains(BaseModel):
    by_type: list[GrainsByTypeRow]
    by_silo: list[GrainsBySiloRow]


class GrainKeys(BaseModel):
    type: str
    active: list[str] = Field(description="A sample of keys with a live activation.")
    persisted: list[str] = Field(description="Keys with persisted state (at most `limit`).")


class GrainState(BaseModel):
    type: str
    key: str
    found: bool
    etag: str | None = None
    size: int = Field(default=0, description="Bytes stored.")
    state: Any = Field(
        default=None,
        description="The state as JSON: registered types as {'__type__': name, ...fields};"
        " tensors and arrays as {'kind', 'dtype', 'shape', 'summary'}; bytes as {'kind': 'bytes', 'size'}.",
    )
    error: str | None = None


class MethodRow(BaseModel):
    grain_type: str
    method: str
    calls: int = Field(description="Completed calls since the silos started.")
    errors: int
    calls_per_s: float
    errors_per_s: float
    error_percent: float = Field(description="errors / calls, since start.")
    mean_ms: float
    p50_ms: float = Field(description="Last window; since start when the window saw no call.")
    p99_ms: float


class Methods(BaseModel):
    sort: str
    order: str
    rows: list[MethodRow]


class JobList(BaseModel):
    jobs: list[JobProgress]


class JobDetail(BaseModel):
    progress: JobProgress
    history: list[JobPoint] = Field(
        description="Curve points, oldest first: train points each tick, eval points where an"
        " evaluation finished (each split its own curves; never one curve of both)."
    )
    metric_names: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Every metric of the job by split ('train': the loss first, then the step"
        " function's; 'eval': the evaluation's), from the record and the points.",
    )
    cancel_requested: bool


class EventList(BaseModel):
    events: list[ClusterEvent] = Field(description="Newest first.")


class AdminResult(BaseModel):
    ok: bool
    detail: str


class ReminderList(BaseModel):
    reminders: list[ReminderInfo] = Field(description="By grain type, key and name.")
    types: list[str] = Field(
        default_factory=list, description="Every grain type with a reminder (for the filter)."
    )


class StreamList(BaseModel):
    streams: list[StreamInfo] = Field(description="By namespace and key.")
    namespaces: list[str] = Field(default_factory=list, description="Every stream namespace (for the filter).")
    truncated: bool = Field(default=False, description="More streams exist than `limit` listed.")
    dead_letters: list[DeadLetters] = Field(
        default_factory=list, description="Per namespace listed, items no subscriber's turn took (if any)."
    )


class LogList(BaseModel):
    entries: list[LogEntry] = Field(description="Oldest first (the newest last).")
    last_id: str | None = Field(
        default=None,
        description="The last stream entry looked at: pass it as `since` for what comes next.",
    )
