"""Settings: one pydantic-settings class, env prefix ``REDGRAIN_``, frozen, read once.

Nested sections are plain models; each component receives only its own
section. Environment variables use ``__`` between section and field, e.g.
``REDGRAIN_MEMBERSHIP__HEARTBEAT_S=0.5``. Durations end in ``_s`` or ``_ms``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TransportSettings(_Section):
    """TCP messaging between silos and clients."""

    call_timeout_s: float = Field(30.0, gt=0, description="Default deadline of a grain call.")
    max_frame_bytes: int = Field(
        1 << 30, gt=1024, description="Largest frame accepted; bigger ones are refused with CodecError."
    )
    max_in_flight: int = Field(
        10_000, gt=0, description="Calls one connection may have outstanding; more wait for a slot within their deadline."
    )
    stream_window: int = Field(
        16,
        gt=0,
        description="Items a streamed call's callee (an async-generator grain method) may produce ahead of"
        " the caller's loop; it waits for the caller past that (back-pressure).",
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="Time allowed to open a connection.")
    cluster_secret: SecretStr | None = Field(
        None, description="Shared secret; when set every connection starts with an HMAC challenge both ways."
    )
    local_sockets: bool = Field(
        True,
        description="Peers on the same host (and network namespace) connect over a Unix socket instead of"
        " loopback TCP: about half the CPU and latency for big tensors.",
    )
    tls_cert: Path | None = Field(
        None,
        description="PEM certificate of this silo or client, signed by tls_ca; with tls_key and tls_ca"
        " every link (TCP and same-host socket, both directions) runs mutual TLS.",
    )
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert.")
    tls_ca: Path | None = Field(
        None, description="PEM certificate(s) of the private CA; peers must present a certificate it signed."
    )
    tls_check_hostname: bool = Field(
        False,
        description="Also require a silo's certificate to name the host it is called at (an IP or DNS"
        " subjectAltName); off: any certificate tls_ca signed is a member (docs/security.md).",
    )

    @model_validator(mode="after")
    def _tls_all_or_none(self) -> Self:
        given = [self.tls_cert is not None, self.tls_key is not None, self.tls_ca is not None]
        if any(given) and not all(given):
            raise ValueError("tls_cert, tls_key and tls_ca must be set together (or none of them)")
        return self

    @property
    def tls(self) -> bool:
        """Whether every link runs mutual TLS."""
        return self.tls_cert is not None


class MembershipSettings(_Section):
    """Heartbeats and failure detection."""

    heartbeat_s: float = Field(
        1.0,
        gt=0,
        description="How often a silo in doubt beats (renews its lease in Redis): while one of its ring monitors "
        "has not probed it for dead_after_s / 4 or more, or a renewal failed; also the quickest a changed "
        "activation count is published.",
    )
    lease_s: float = Field(
        20.0,
        gt=0,
        description="A silo's liveness lease: renewed every lease_s / 2 while all is well; a silo whose last "
        "confirmed renewal is older than this refuses calls (fenced), and peers that can still probe it vote "
        "it dead once its heartbeat is lease_s + dead_after_s old.",
    )
    suspect_after_s: float = Field(
        3.0, gt=0, description="A monitored silo that has not answered a probe for this long is suspected."
    )
    probe_timeout_s: float = Field(1.0, gt=0, description="Time a direct TCP probe may take.")
    dead_after_s: float = Field(
        4.0,
        gt=0,
        description="A silo that has answered none of its monitors' probes this long, its heartbeat as old, is "
        "declared dead. A silo that one of its monitors has not probed for half of this refuses calls (fenced) "
        "unless a heartbeat as young is confirmed (it beats every heartbeat_s meanwhile).",
    )
    refresh_s: float = Field(
        15.0,
        gt=0,
        description="How often a silo or client polls the membership version and a sample of loads "
        "(pub/sub tells every change sooner: this is the fallback); changes are read from the change feed.",
    )
    monitors: int = Field(
        10,
        ge=1,
        description="Ring successors each silo probes and votes on (all peers when fewer), so each silo "
        "is watched by about this many others whatever the cluster's size.",
    )
    load_sample: int = Field(
        15,
        ge=0,
        description="Silos' published loads (for placement) each silo or client re-reads every refresh_s, "
        "in turn; all of them when there are no more silos than this.",
    )
    probe_interval_s: float = Field(
        0.25,
        gt=0,
        description="How often each monitored peer is pinged over TCP (and, while one is in doubt, monitored "
        "heartbeats read); a refused connection votes it dead at once.",
    )
    idle_read_s: float = Field(
        30.0,
        gt=0,
        description="While every monitored peer answers its pings and membership is unchanged, a detector reads "
        "their heartbeats this often only (a silo that lost Redis but answers pings is noticed up to this late "
        "after its lease ran out).",
    )


class CatalogSettings(_Section):
    """Activations on one silo."""

    idle_timeout_s: float = Field(
        900.0, gt=0, description="Activations unused this long are collected (per type: @idle_timeout)."
    )
    collection_interval_s: float = Field(5.0, gt=0, description="How often idle activations are swept.")
    max_queue: int = Field(
        10_000,
        gt=0,
        description="Calls one activation may have queued: past it a two-way call is shed (LoadShedError, "
        "retried by its caller's router until its deadline); up to as many one-way calls wait behind, in order.",
    )
    deactivation_timeout_s: float = Field(
        10.0, gt=0, description="Time on_deactivate and draining may take; turns still running after it are cancelled."
    )
    thread_pool_size: int = Field(
        2, gt=0, description="Threads for Grain.run_in_thread (CPU-heavy work off the event loop)."
    )
    slow_turn_ms: float = Field(100.0, gt=0, description="Watchdog: log any turn holding the loop longer.")


class DirectorySettings(_Section):
    """Where grains live: the lookup cache of a silo or client."""

    cache_size: int = Field(
        1_000_000,
        ge=0,
        description="Grain locations a silo or client caches (about 105 B an entry, plus the grain id when "
        "nothing else holds it); a call to a grain not in it reads the directory in Redis first.",
    )


class RebalancerSettings(_Section):
    """The cluster's one rebalancer (elected) and the handoff on drain."""

    enabled: bool = Field(True, description="Take part in the rebalancer election on this silo.")
    period_s: float = Field(5.0, gt=0, description="How often the leader compares loads and orders moves.")
    max_moves_per_period: int = Field(
        20,
        ge=0,
        description="Activations each silo is told to move away per period at most (the cluster's rate "
        "grows with the silos above the mean), so training is not disturbed.",
    )
    tolerance: float = Field(
        0.2, ge=0, description="A silo is overloaded above mean * (1 + tolerance) movable activations; one below "
        "mean * (1 - tolerance) draws from every silo above the mean.",
    )
    lease_ttl_s: float = Field(
        15.0,
        gt=0,
        description="Leader lease in Redis, renewed every third of it; a leader declared dead is replaced at "
        "once, one that stops renewing otherwise after this.",
    )


_IMPORT_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"
_PROVIDER_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class ProviderSettings(_Section):
    """One storage provider: a factory named by import path, and its keyword options."""

    factory: str = Field(
        pattern=_IMPORT_PATH,
        description="``package.module:callable`` called as ``factory(context, **options)`` at silo start;"
        " it returns the provider (a ``silo.storage.store.StateStore``).",
    )
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the factory.")

    @model_validator(mode="before")
    @classmethod
    def _path_alone(cls, value: Any) -> Any:
        # "pkg.mod:factory" stands for {"factory": "pkg.mod:factory"}: the common case is one line.
        return {"factory": value} if isinstance(value, str) else value


class StorageSettings(_Section):
    """Grain state: the Redis store's tuning, and further storage providers by name."""

    providers: dict[str, ProviderSettings] = Field(
        default_factory=dict,
        description='Storage providers besides "redis", by name: {"name": "pkg.mod:factory"} or'
        ' {"name": {"factory": ..., "options": {...}}}; a grain picks one with @storage("name").',
    )
    default_provider: str = Field(
        "redis", pattern=_PROVIDER_NAME, description="Provider of grains that name none (redis or a providers name)."
    )

    chunk_bytes: int = Field(8 << 20, gt=0, description="Size of one chunk of a state stored in chunks.")
    inline_bytes: int = Field(
        64 << 10,
        ge=0,
        description="States up to this size go inline in the head hash (one script call); bigger ones to chunks.",
    )
    retries: int = Field(3, ge=0, description="Retries of a state operation on a Redis error.")
    retry_backoff_s: float = Field(0.1, gt=0, description="First backoff between retries (doubles).")
    orphan_ttl_s: int = Field(
        3600, gt=0, description="Chunks of a write that never committed (writer crashed) expire after this."
    )
    keep_snapshots: int = Field(
        3, gt=0, description="Complete checkpoint snapshots kept per group unless a save says otherwise."
    )

    @model_validator(mode="after")
    def _known_providers(self) -> Self:
        for name in self.providers:
            if name == "redis" or not re.match(_PROVIDER_NAME, name):
                raise ValueError(f"storage provider name {name!r} is reserved or not [A-Za-z0-9_.-]{{1,64}}")
        if self.default_provider != "redis" and self.default_provider not in self.providers:
            raise ValueError(f"default_provider {self.default_provider!r} is not redis nor one of providers")
        return self


class RemindersSettings(_Section):
    """Durable reminders in Redis."""

    poll_interval_s: float = Field(
        1.0, gt=0, description="Least time between two claims of due reminders by one silo (a reminder fires up to "
        "this late while others keep it busy)."
    )
    idle_poll_s: float = Field(
        30.0, gt=0, description="Longest a silo waits to claim when nothing falls due sooner; a reminder registered "
        "through it, a tick it acknowledged or a membership change wakes it, so this only bounds how late a tick "
        "another silo leased then lost fires."
    )
    batch: int = Field(100, gt=0, description="Most due reminders one silo claims per poll.")
    delivery_timeout_s: float = Field(30.0, gt=0, description="Deadline of one reminder delivery call.")


class StreamSettings(_Section):
    """Streams on Redis Streams (silo/streams/): retention, and how silos deliver to ``@subscribes`` grains."""

    maxlen: int | None = Field(
        100_000, gt=0, description="Items a stream keeps at most (trimmed on publish); None: no cap."
    )
    max_age_s: float | None = Field(
        None, gt=0, description="Items older than this are trimmed on publish and by the silos every"
        " retention_interval_s (by token time); None: no limit.",
    )
    approximate_trim: bool = Field(
        True,
        description="Trim with XADD/XTRIM '~' (whole radix nodes, cheap; a stream keeps up to ~100 more);"
        " off: exactly maxlen / max_age_s.",
    )
    lease_s: float = Field(
        5.0, gt=0, description="A silo's hold on one stream key (renewed every third of it); a silo that"
        " stops renewing loses its keys to another silo this long after, or once declared dead.",
    )
    discover_interval_s: float = Field(
        0.5, gt=0, description="How often a silo reads the stream keys of its @subscribes namespaces."
    )
    block_ms: int = Field(
        250, gt=0, lt=4000, description="Longest wait of one blocking stream read (below the Redis socket timeout).",
    )
    batch: int = Field(64, gt=0, description="Items read from one stream key at a time.")
    delivery_timeout_s: float = Field(
        30.0, gt=0, description="Deadline of one attempt at delivering an item to an @subscribes grain."
    )
    max_attempts: int = Field(
        5, ge=1, description="Attempts at one item (any failure counts: the grain raised, the attempt outlasted"
        " delivery_timeout_s, no silo could run it) before it goes to the namespace's dead-letter stream"
        " and the key's next item follows.",
    )
    retention_interval_s: float = Field(
        30.0, gt=0, description="How often one silo of the cluster trims every stream to max_age_s (a stream"
        " nobody publishes to is trimmed too), deletes empty streams no subscriber is owed anything from,"
        " and prunes stream keys and namespaces left without a stream.",
    )
    dead_letter_maxlen: int = Field(
        10_000, gt=0, description="Entries a namespace's dead-letter stream keeps, about (XADD MAXLEN ~)."
    )


class LogStreamSettings(_Section):
    """Log records published to the cluster's log stream (the dashboard's Logs page)."""

    enabled: bool = Field(True, description="Publish this silo's log records to Redis.")
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        "WARNING",
        description="Lowest level published (INFO also needs the process's logging at INFO, as the CLI sets).",
    )
    max_len: int = Field(10_000, gt=0, description="Records the stream keeps, about (XADD MAXLEN ~).")
    queue: int = Field(
        1000, gt=0, description="Records waiting for Redis at most; when full the oldest are dropped."
    )


class RetentionSettings(_Section):
    """What dead silos leave in Redis, and how long it stays (silo/cluster/housekeeping.py)."""

    dead_silo_s: float = Field(
        3600.0,
        ge=0,
        description="A Dead silo's membership row (and its per-silo keys) is deleted this long after"
        " its last heartbeat; until then the dashboard lists it.",
    )
    period_s: float = Field(60.0, gt=0, description="How often each silo sweeps for such rows.")


class TracingSettings(_Section):
    """OpenTelemetry spans for grain calls (silo/tracing.py; needs ``pip install redgrain[otel]``)."""

    enabled: bool = Field(
        False, description="Make every grain call a span, exported over OTLP (off: one None test a call)."
    )
    otlp_endpoint: str | None = Field(
        None, description="OTLP/gRPC collector; unset: OTEL_EXPORTER_OTLP_ENDPOINT, else localhost:4317."
    )
    service_name: str = Field("redgrain", description="The spans' service.name.")


def _check_import_paths(paths: tuple[str, ...]) -> tuple[str, ...]:
    for path in paths:
        if not re.match(_IMPORT_PATH, path):
            raise ValueError(f"{path!r} is not an import path of the form package.module:name")
    return paths


_CLUSTER_SECRET_DESCRIPTION = (
    "Shared secret (REDGRAIN_CLUSTER_SECRET); the same as transport.cluster_secret, which it fills in."
)


class _SecretAlias(BaseSettings):
    """``cluster_secret`` at the top level, flowing into ``transport.cluster_secret``."""

    cluster_secret: SecretStr | None = Field(None, description=_CLUSTER_SECRET_DESCRIPTION)
    transport: TransportSettings = TransportSettings()

    @model_validator(mode="after")
    def _share_secret(self) -> Self:
        top, nested = self.cluster_secret, self.transport.cluster_secret
        if top is not None and nested is not None and top.get_secret_value() != nested.get_secret_value():
            raise ValueError("cluster_secret and transport.cluster_secret are both set and differ")
        # Frozen models: the validator is the one place allowed to fill these in.
        if top is not None and nested is None:
            object.__setattr__(self, "transport", self.transport.model_copy(update={"cluster_secret": top}))
        elif nested is not None and top is None:
            object.__setattr__(self, "cluster_secret", nested)
        return self


class SiloSettings(_SecretAlias):
    """Everything a silo reads at start."""

    model_config = SettingsConfigDict(
        env_prefix="REDGRAIN_", env_nested_delimiter="__", frozen=True, extra="ignore"
    )

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis holding the cluster state: `redis://` (one server; a Redis Cluster node is taken as its "
        "cluster), `redis+sentinel://h:p[,h:p]/service`, or `redis+cluster://h:p[,h:p]` (docs/cluster.md).",
    )
    cluster: str = Field("default", description="Cluster name; all keys live under rg:{cluster}:.")
    host: str = Field("127.0.0.1", description="Address the silo binds and advertises.")
    advertise_host: str | None = Field(None, description="Address peers use, when it differs from host.")
    port: int = Field(0, ge=0, lt=65536, description="TCP port; 0 picks a free one.")
    grains: tuple[str, ...] = Field(
        (), description="Modules whose Grain classes this silo hosts (the allow-list)."
    )
    roles: tuple[str, ...] = Field((), description="Role labels for @silo_role placement.")
    device: str = Field("auto", description="Torch device for training grains: auto, cpu or cuda.")
    transport: TransportSettings = TransportSettings()
    membership: MembershipSettings = MembershipSettings()
    catalog: CatalogSettings = CatalogSettings()
    directory: DirectorySettings = DirectorySettings()
    storage: StorageSettings = StorageSettings()
    reminders: RemindersSettings = RemindersSettings()
    rebalancer: RebalancerSettings = RebalancerSettings()
    logs: LogStreamSettings = LogStreamSettings()
    tracing: TracingSettings = TracingSettings()
    retention: RetentionSettings = RetentionSettings()
    streams: StreamSettings = StreamSettings()
    stats_interval_s: float = Field(
        1.0, gt=0, description="How often silo stats are published while the silo works (calls, activations)."
    )
    stats_idle_interval_s: float = Field(
        30.0,
        gt=0,
        description="How often they are published while nothing changes (no calls, the same activations and "
        "status): an idle silo costs Redis almost nothing (the dashboard shows an idle silo's figures this late).",
    )
    incoming_filters: tuple[str, ...] = Field(
        (),
        description="Incoming call filters by import path (pkg.mod:name; a class is instantiated with no"
        ' arguments), run in this order around every call to this silo\'s grains (a JSON list: ["pkg.mod:f"]).',
    )
    outgoing_filters: tuple[str, ...] = Field(
        (), description="Outgoing call filters by import path, run in this order on every call this silo's grains make."
    )
    startup_timeout_s: float = Field(
        300.0, gt=0, description="Time all @on_silo_start tasks together may take before the start fails."
    )

    @field_validator("incoming_filters", "outgoing_filters")
    @classmethod
    def _import_paths(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        return _check_import_paths(paths)


class ClientSettings(_SecretAlias):
    """Everything a ClusterClient reads at connect."""

    model_config = SettingsConfigDict(
        env_prefix="REDGRAIN_", env_nested_delimiter="__", frozen=True, extra="ignore"
    )

    redis_url: str = "redis://127.0.0.1:6379/0"
    cluster: str = "default"
    transport: TransportSettings = TransportSettings()
    tracing: TracingSettings = TracingSettings()
    membership: MembershipSettings = MembershipSettings()
    outgoing_filters: tuple[str, ...] = Field(
        (), description="Outgoing call filters by import path, run in this order on every call the client makes."
    )

    @field_validator("outgoing_filters")
    @classmethod
    def _import_paths(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        return _check_import_paths(paths)

    streams: StreamSettings = StreamSettings()
    directory: DirectorySettings = DirectorySettings()
