"""A silo's start stages and their undo: wherever a start fails, it leaves nothing behind.

"Nothing" is checked the same way after every ending (a start failed at each
stage in turn, a plain start and stop, a silo declared dead): no task left,
nothing listening on its port, no Unix socket file, no Redis connection of
its own, no heartbeat thread, no membership row claiming it is alive.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
import redis

from silo import errors
from silo.keys import Keys
from silo.messaging import local_socket
from silo.records.membership import MemberRow, SiloStatus
from silo.settings import SiloSettings
from silo.silo import Silo, SiloState
from tests.conftest import FAST_MEMBERSHIP
from tests.sample_grains import Echo, Ticker, Worker


class InjectedFailure(Exception):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Probe:
    """What a silo on ``port`` may leave behind, measured before it starts and after it ends."""

    redis: redis.Redis
    keys: Keys
    port: int
    tasks: set[asyncio.Task[object]]
    clients: int

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def settings(self, redis_url: str, cluster: str) -> SiloSettings:
        return SiloSettings(
            redis_url=redis_url,
            cluster=cluster,
            grains=("tests.sample_grains",),
            membership=FAST_MEMBERSHIP,
            port=self.port,
        )

    def rows(self) -> list[MemberRow]:
        return [MemberRow.model_validate_json(raw) for raw in self.redis.hvals(self.keys.members)]

    async def assert_nothing_left(self) -> None:
        # Tasks a stop set going (a pub/sub close) may need a turn or two to end;
        # one that is still running after two seconds was left behind.
        left = asyncio.all_tasks() - self.tasks - {asyncio.current_task()}
        if left:
            await asyncio.wait(left, timeout=2.0)
        assert [t for t in left if not t.done()] == []
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
        path = local_socket.socket_path(self.endpoint)
        assert path is not None and not path.exists()
        assert [t.name for t in threading.enumerate() if t.name.startswith(f"heartbeat {self.endpoint}@")] == []
        # The server drops a closed client when it reads the EOF: give it a moment.
        deadline = time.monotonic() + 2.0
        while len(self.redis.client_list()) > self.clients and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(self.redis.client_list()) <= self.clients, [(c["cmd"], c["age"]) for c in self.redis.client_list()]


@pytest.fixture
async def probe(redis_url: str, cluster_name: str) -> AsyncIterator[Probe]:
    client = redis.Redis.from_url(redis_url)
    try:
        client.ping()
        yield Probe(client, Keys(cluster_name), _free_port(), set(asyncio.all_tasks()), len(client.client_list()))
    finally:
        client.close()


def _fail_after(stage: str) -> Callable[[Silo], Awaitable[None]]:
    original = getattr(Silo, f"_stage_{stage}")

    async def stage_then_fail(self: Silo) -> None:
        await original(self)
        raise InjectedFailure(stage)

    return stage_then_fail


@pytest.mark.parametrize("stage", Silo.START_STAGES)
async def test_a_start_that_fails_after_any_stage_unwinds_everything_it_started(
    stage: str, probe: Probe, redis_url: str, cluster_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Silo, f"_stage_{stage}", _fail_after(stage))
    silo = Silo(probe.settings(redis_url, cluster_name))
    with pytest.raises(InjectedFailure):
        await silo.start()
    assert silo.status is SiloState.STOPPED and silo.stopped.is_set()
    await probe.assert_nothing_left()
    # A silo that joined leaves its row Dead (peers may have seen it); one that did not, none.
    joined = Silo.START_STAGES.index(stage) >= Silo.START_STAGES.index("join")
    assert [(r.port, r.status) for r in probe.rows()] == ([(probe.port, SiloStatus.DEAD)] if joined else [])
    await silo.stop()  # a stopped silo's stop returns at once


async def test_a_start_on_a_port_in_use_fails_in_listen_and_leaves_nothing(
    probe: Probe, redis_url: str, cluster_name: str
) -> None:
    taken = socket.create_server(("127.0.0.1", probe.port))
    try:
        silo = Silo(probe.settings(redis_url, cluster_name))
        with pytest.raises(OSError):
            await silo.start()
    finally:
        taken.close()
    await probe.assert_nothing_left()
    assert probe.rows() == []


async def test_a_start_without_redis_fails_first_and_leaves_nothing(
    probe: Probe, cluster_name: str
) -> None:
    silo = Silo(probe.settings(f"redis://127.0.0.1:{_free_port()}/0", cluster_name))
    with pytest.raises(errors.StorageError):
        await silo.start()
    assert silo.status is SiloState.STOPPED
    await probe.assert_nothing_left()


async def test_a_start_and_graceful_stop_leave_nothing_and_the_row_dead(
    probe: Probe, redis_url: str, cluster_name: str
) -> None:
    silo = await Silo(probe.settings(redis_url, cluster_name)).start()
    assert silo.status is SiloState.ACTIVE and silo.status == "active"
    assert await silo.get_grain(Echo, "a").echo(7) == 7
    address = str(silo.address)
    assert probe.redis.scard(probe.keys.directory_index(address)) == 1
    await silo.stop()
    assert silo.status is SiloState.STOPPED and not silo.declared_dead
    await probe.assert_nothing_left()
    assert [r.status for r in probe.rows()] == [SiloStatus.DEAD]
    assert probe.redis.scard(probe.keys.directory_index(address)) == 0


async def test_a_stop_without_hand_off_ends_its_activations_timers_and_turns(
    probe: Probe, redis_url: str, cluster_name: str
) -> None:
    # A CI run: a stop with graceful=False (the test fixtures', the loop shutdown's) left its
    # activations live; a serving grain's poll timer ticked on into the stopped silo, and a tick
    # started while the loop cancelled its tasks was closed by the garbage collector a test later.
    silo = await Silo(probe.settings(redis_url, cluster_name)).start()
    ticker = silo.get_grain(Ticker, "t")
    await ticker.start(0.01)
    assert await asyncio.wait_for(ticker.wait_ticks(), 5) >= 3
    busy = asyncio.ensure_future(silo.get_grain(Worker, 0).work(600))
    while not silo.catalog.running_turns():  # no event says a turn started: look each 10 ms
        await asyncio.sleep(0.01)
    act = next(a for a in silo.catalog.activations() if a.grain_id.type_name == "Ticker")
    timers = list(act.timers)
    assert timers
    await silo.stop(graceful=False)
    assert silo.status is SiloState.STOPPED and act.deactivated.is_set() and not act.timers
    assert all(t._handle is None for t in timers)  # cancelled, not just forgotten: no tick comes
    with pytest.raises(errors.GrainDeactivatedError, match="silo stopped"):
        await asyncio.wait_for(busy, 5)  # told, not left to its 600 s
    await probe.assert_nothing_left()  # no turn, no timer's tick, left running


async def test_a_silo_declared_dead_stops_at_once_and_touches_nothing_in_redis(
    probe: Probe, redis_url: str, cluster_name: str
) -> None:
    silo = await Silo(probe.settings(redis_url, cluster_name)).start()
    assert await silo.get_grain(Echo, "a").echo(1) == 1
    address = str(silo.address)
    # What a vote does: the row becomes Dead; the silo hears so on its next heartbeat.
    row = MemberRow.model_validate_json(probe.redis.hget(probe.keys.members, address) or b"")
    probe.redis.hset(probe.keys.members, address, row.model_copy(update={"status": SiloStatus.DEAD}).model_dump_json())
    await asyncio.wait_for(silo.stopped.wait(), 5.0)
    assert silo.declared_dead and silo.status is SiloState.DEAD
    await probe.assert_nothing_left()  # its port refuses: it stopped serving
    # Its directory entries stay for the cluster's failover to purge: a zombie writes nothing.
    assert probe.redis.scard(probe.keys.directory_index(address)) == 1
    await silo.stop()  # returns at once: it is already down
    assert silo.status is SiloState.DEAD
