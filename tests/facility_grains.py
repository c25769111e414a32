"""Plain user grains that use the facilities a grain reaches through its context
(``grains.checkpoints.snapshots``, ``grains.workload.workload``), as docs/state.md and
docs/dashboard.md show them; tests/grains/test_checkpoints.py and test_workload.py."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from grains import Grain
from grains.checkpoints import snapshots
from grains.workload import workload

GROUP = "notes"


class Notebook(Grain):
    """Pages it checkpoints with its group, as any user's grain would."""

    class State(BaseModel):
        pages: list[str] = []

    async def write(self, page: str) -> list[str]:
        self.state.pages.append(page)
        await self.write_state()
        return list(self.state.pages)

    async def pages(self) -> list[str]:
        return list(self.state.pages)

    async def save(self, snapshot_id: int, members: list[str] | None = None, keep: int = 3) -> bool:
        return await snapshots(self).save(GROUP, snapshot_id, members, keep=keep)

    async def restore(self, snapshot_id: int | None = None, write: bool = True) -> str:
        return await snapshots(self).load(GROUP, snapshot_id, write=write)

    async def peek(self, snapshot_id: int, member: str) -> list[str]:
        """Another member's pages in a snapshot, without touching this grain's own."""
        decoded = await snapshots(self).read_member(GROUP, snapshot_id, member)
        return list(decoded.pages)

    async def catalogue(self) -> dict[str, Any]:
        """What the facility's readers say of the group, as plain values."""
        store = snapshots(self)
        latest = await store.latest_complete(GROUP)
        info = await store.info(GROUP, latest.snapshot_id) if latest is not None else None
        return {
            "groups": await store.groups(),
            "complete": [i.snapshot_id for i in await store.list(GROUP)],
            "pending": [i.snapshot_id for i in await store.list(GROUP, pending=True)],
            "latest": latest.snapshot_id if latest is not None else None,
            "members": list(info.members) if info is not None else [],
        }

    async def drop(self, snapshot_id: int) -> bool:
        return await snapshots(self).delete(GROUP, snapshot_id)


class Progress(BaseModel):
    """A user's own progress schema (the dashboard stores whatever model it is given)."""

    job: str
    done: int
    note: str = ""


class Batch(Grain):
    """A user's long-running job that reports progress and keeps a rendezvous key."""

    async def report(self, done: int, points: list[dict[str, Any]], restart: bool = False) -> bool:
        return await workload(self).publish_progress(
            self.key, Progress(job=self.key, done=done), points, restart_history=restart
        )

    async def meet(self, generation: int, value: str) -> str:
        """Write one key under the job's rendezvous prefix with the silo's client; the key."""
        store = workload(self)
        redis = store.redis_client()
        assert redis is not None
        key = store.rendezvous_prefix(self.key, generation) + "ready"
        await redis.set(key, value)
        return key

    async def forget(self) -> None:
        await workload(self).forget_progress(self.key)
