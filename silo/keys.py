"""Every Redis key redgrain uses, built in one place.

All keys of a cluster live under ``rg:{cluster}:``. The braces make the
cluster name a Redis Cluster hash tag, so every multi-key Lua script of one
cluster touches one slot.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    cluster: str

    @property
    def prefix(self) -> str:
        return f"rg:{{{self.cluster}}}:"

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

    def heartbeat(self, silo: str) -> str:
        """String with a TTL: the silo's last heartbeat time."""
        return self.prefix + f"hb:{silo}"

    def suspicions(self, silo: str) -> str:
        """Hash: voter silo -> time it voted the silo dead."""
        return self.prefix + f"suspect:{silo}"

    @property
    def generation(self) -> str:
        """Counter handing each silo process start a new generation."""
        return self.prefix + "generation"

    # --- directory ---------------------------------------------------------
    def directory_entry(self, grain: str) -> str:
        """Hash: silo, activation, token for one grain id."""
        return self.prefix + f"dir:{grain}"

    def directory_index(self, silo: str) -> str:
        """Set of grain ids whose directory entry names this silo."""
        return self.prefix + f"dirindex:{silo}"

    @property
    def fencing_counter(self) -> str:
        return self.prefix + "fence"

    # --- grain types -------------------------------------------------------
    @property
    def grain_types(self) -> str:
        """Hash: grain type name -> msgpack manifest (methods and markers)."""
        return self.prefix + "types"

    # --- state -------------------------------------------------------------
    def state_head(self, grain: str) -> str:
        """Hash: etag, version, chunk count, size of the visible state."""
        return self.prefix + f"state:{grain}"

    def state_chunk(self, grain: str, version: int, index: int) -> str:
        return self.prefix + f"state:{grain}:v{version}:{index}"

    def state_types(self) -> str:
        """Set of grain types that have persisted state (for the dashboard)."""
        return self.prefix + "state:types"

    def state_index(self, type_name: str) -> str:
        """Set of keys of one grain type that have persisted state."""
        return self.prefix + f"state:index:{type_name}"

    def checkpoint_index(self, group: str) -> str:
        """Sorted set: snapshot id scored by creation time."""
        return self.prefix + f"ckpt:{group}"

    def checkpoint_manifest(self, group: str, snapshot: str) -> str:
        return self.prefix + f"ckpt:{group}:{snapshot}"

    # --- reminders ---------------------------------------------------------
    @property
    def reminders(self) -> str:
        """Sorted set: reminder id scored by its next due time."""
        return self.prefix + "reminders"

    @property
    def reminder_rows(self) -> str:
        """Hash: reminder id -> msgpack row (grain, name, period)."""
        return self.prefix + "reminders:rows"

    # --- cluster services --------------------------------------------------
    def leader(self, role: str) -> str:
        """String with a TTL: which silo holds a cluster-wide role (rebalancer)."""
        return self.prefix + f"leader:{role}"

    def silo_stats(self, silo: str) -> str:
        """String with a TTL: the silo's latest published stats record."""
        return self.prefix + f"stats:{silo}"

    @property
    def silo_stats_index(self) -> str:
        return self.prefix + "stats:index"

    @property
    def events(self) -> str:
        """Capped stream of cluster events (joins, deaths, moves)."""
        return self.prefix + "events"

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

    def rendezvous(self, job: str, generation: int) -> str:
        """Prefix for torch.distributed store keys of one group generation."""
        return self.prefix + f"rdzv:{job}:{generation}:"

    def control(self, silo: str) -> str:
        """List: admin commands for one silo (drain)."""
        return self.prefix + f"control:{silo}"
