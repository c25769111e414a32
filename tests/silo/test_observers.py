"""Observers: a client's or a grain's local object called back by grains, and ObserverSet.

Real silo processes (or silos in this process) on a real redis, a client in this
process, and, for the killed client, a client in a process of its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgpack
import pytest

from grains import DeactivationReason, GrainId, ObserverRef
from silo import errors
from silo.client import ClusterClient
from silo.codec import Codec
from silo.messaging.observer_hub import ObserverHub
from silo.testing import InProcessCluster, InProcessSilo
from tests.helpers import REPO
from tests.observer_grains import CallsBack, Collector, Room, Watcher

GRAINS = "tests.observer_grains"

CLIENT_SCRIPT = """
import asyncio, sys
from silo.client import ClusterClient
from silo.codec import Codec
from silo.messaging.observer_hub import ObserverHub
from tests.observer_grains import Collector

async def main(url, cluster, room):
    client = await ClusterClient.connect(url, cluster=cluster)
    handler = Collector()
    obs = await client.observer(handler)
    await client.get_grain("Room", room).join(obs)
    print("joined", obs.observer_id, flush=True)
    while True:
        await handler.arrived.wait()
        handler.arrived.clear()
        print("message", handler.messages[-1], flush=True)

asyncio.run(main(*sys.argv[1:4]))
"""


async def _line(proc: subprocess.Popen[str], prefix: str, timeout_s: float = 60.0) -> str:
    """The next line of ``proc``'s output that starts with ``prefix`` (read off the loop)."""

    def read() -> str:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(prefix):
                return line.strip()
        raise AssertionError(f"client process ended before printing {prefix!r} (exit {proc.poll()})")

    return await asyncio.wait_for(asyncio.to_thread(read), timeout_s)


def _spawn_client(redis_url: str, cluster: str, room: str, tmp_path: Path) -> subprocess.Popen[str]:
    script = tmp_path / "observer_client.py"
    script.write_text(textwrap.dedent(CLIENT_SCRIPT))
    return subprocess.Popen(
        [sys.executable, str(script), redis_url, cluster, room],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


async def test_a_client_observer_receives_a_grains_notification(silo_processes, client: ClusterClient) -> None:
    silo_processes(1, grains=GRAINS)
    room = client.get_grain(Room, "lobby")
    assert await room.size() == 0  # connected before it has an observer: it names itself on it then
    handler = Collector()
    obs = await client.observer(handler)
    assert await room.join(obs) == 1
    # Notified from a later call: the grain kept the reference, and calls back over our connection.
    assert await room.say("hello") == {"delivered": 1, "gone": [], "failed": {}}
    assert handler.messages == ["hello"]
    assert await room.tell(obs, "direct") == "got direct"  # the handler's answer reaches the grain
    # A @one_way handler method: the grain's await returns once it is sent; its effect lands.
    handler.arrived.clear()
    assert await room.note("n") == 1
    await asyncio.wait_for(handler.arrived.wait(), 10)
    assert handler.messages == ["hello", "direct", "note n"]
    # The reference came back from the grain: the same observer, equal and callable here.
    (back,) = await room.members_now()
    assert back == obs and await back.on_message("from here") == "got from here"
    stats = client.statistics()["observers"]
    assert (stats.calls_in, stats.calls_out) == (4, 1)  # three from the grain, and ours


async def test_a_killed_client_is_dropped_from_the_set_while_a_live_one_still_receives(
    silo_processes, client: ClusterClient, redis_url: str, cluster_name: str, tmp_path: Path
) -> None:
    silo_processes(1, grains=GRAINS)
    live = Collector()
    room = client.get_grain(Room, "chat")
    assert await room.join(await client.observer(live)) == 1
    proc = _spawn_client(redis_url, cluster_name, "chat", tmp_path)
    try:
        dead_id = (await _line(proc, "joined")).split()[1]
        assert await room.size() == 2
        assert (await room.say("before")) == {"delivered": 2, "gone": [], "failed": {}}
        assert await _line(proc, "message") == "message before"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    (dead,) = [m for m in await room.members_now() if str(m.observer_id) == dead_id]
    # Called directly from here: relayed through the silo the client was connected to, which has
    # no connection from it any more.
    with pytest.raises(errors.ObserverGoneError, match="gone"):
        await dead.on_message("anyone there?")
    assert await room.is_gone(dead)  # and from the grain itself
    with pytest.raises(ValueError, match="only it can dispose"):
        await dead.dispose()
    result = await room.say("after")
    assert result == {"delivered": 1, "gone": [dead_id], "failed": {}}
    assert await room.size() == 1 and live.messages == ["before", "after"]
    assert await room.say("again") == {"delivered": 1, "gone": [], "failed": {}}


async def test_a_grains_own_observer_is_called_by_a_grain_on_another_silo(cluster, client: ClusterClient) -> None:
    a, b = await cluster(2, grains=(GRAINS,))
    await client.refresh()
    watcher, room = client.get_grain(Watcher, "w"), client.get_grain(Room, "r")
    await client.router.activate(watcher.grain_id, a.address)
    await client.router.activate(room.grain_id, b.address)
    obs = await watcher.watch("r")
    assert obs.observer_id.owner == str(a.address)
    assert await room.say("across") == {"delivered": 1, "gone": [], "failed": {}}
    assert await watcher.seen() == ["across"]
    assert b.observers.statistics().calls_out == 1 and a.observers.statistics().calls_in == 1
    # It lives as long as the activation that made it.
    act = a.catalog.get(watcher.grain_id)
    assert act is not None
    await a.catalog.deactivate(act, DeactivationReason.REQUESTED)
    assert await room.say("after") == {"delivered": 0, "gone": [str(obs.observer_id)], "failed": {}}
    assert await room.size() == 0


async def test_a_silo_the_client_is_not_connected_to_relays_through_one_it_is(cluster, client: ClusterClient) -> None:
    a, b = await cluster(2, grains=(GRAINS,))
    await client.refresh()
    near, far = client.get_grain(Room, "near"), client.get_grain(Room, "far")
    await a.router.activate(near.grain_id, a.address)
    await a.router.activate(far.grain_id, b.address)
    handler = Collector()
    obs = await client.observer(handler)
    # The client talks to silo a only; the reference reaches the room on b through the room on a.
    assert await near.forward(obs, "far") == 1
    assert await near.say_in("far", "via a") == {"delivered": 1, "gone": [], "failed": {}}
    assert handler.messages == ["via a"]
    assert client.transport.open_endpoints() == [a.address.endpoint]
    assert (a.observers.statistics().relayed, b.observers.statistics().calls_out) == (1, 1)
    await client.close()  # its connection to a closes: the gateway has nobody to relay to
    async with await ClusterClient.connect(client.redis_url, cluster=client.settings.cluster) as other:
        gone = await other.get_grain(Room, "near").say_in("far", "anyone?")
    assert gone == {"delivered": 0, "gone": [str(obs.observer_id)], "failed": {}}


async def test_a_handler_calling_back_into_the_waiting_grain_is_a_deadlock_not_a_hang(cluster, client: ClusterClient) -> None:
    await cluster(1, grains=(GRAINS,))
    room = client.get_grain(Room, "loop")
    handler = CallsBack(room)
    obs = await client.observer(handler)
    await room.join(obs)
    # The room waits on the notification; the handler's call back carries that chain.
    result = await asyncio.wait_for(room.say("x"), 10)
    assert result == {"delivered": 0, "gone": [], "failed": {str(obs.observer_id): "DeadlockError"}}
    # A one-way notification waits on nobody: its call back is an ordinary call.
    assert await room.note("n") == 1
    await asyncio.wait_for(handler.arrived.wait(), 10)
    assert handler.messages == ["size 1"]


async def test_observer_calls_honour_their_deadline_and_cancel_the_handler(silo_processes, client: ClusterClient) -> None:
    silo_processes(1, grains=GRAINS)
    handler = Collector()
    obs = await client.observer(handler)
    room = client.get_grain(Room, "slow")
    with pytest.raises(errors.GrainTimeoutError):
        await room.tell_slowly(obs, 30.0, 0.3)
    await asyncio.wait_for(handler.cancelled.wait(), 10)  # the CANCEL reached this client


async def test_a_disposed_observer_or_a_closed_clients_is_gone(
    silo_processes, client: ClusterClient, redis_url: str, cluster_name: str
) -> None:
    silo_processes(1, grains=GRAINS)
    room = client.get_grain(Room, "d")
    disposed = await client.observer(Collector())
    await room.join(disposed)
    await disposed.dispose()
    assert await room.is_gone(disposed)
    other = await ClusterClient.connect(redis_url, cluster=cluster_name)
    try:
        closed = await other.observer(Collector())
        await other.get_grain(Room, "d").join(closed)
    finally:
        await other.close()
    assert await room.is_gone(closed)
    result = await room.say("anyone?")
    assert sorted(result["gone"]) == sorted([str(disposed.observer_id), str(closed.observer_id)])
    assert await room.size() == 0


async def test_an_unknown_method_on_an_observer_is_a_clear_error(silo_processes, client: ClusterClient) -> None:
    silo_processes(1, grains=GRAINS)
    obs = await client.observer(Collector())
    with pytest.raises(AttributeError, match="no public async method 'nope'.*on_message"):
        obs.nope  # noqa: B018 - the attribute access is what fails
    with pytest.raises(AttributeError, match="sync_helper"):
        obs.sync_helper  # noqa: B018 - not async: not part of the interface
    # A reference that claims more than the handler has (an older or forged one): the owner says
    # no, over the wire (a grain calls it) and here.
    forged = ObserverRef(client.observers, obs.observer_id, frozenset({"on_message", "nope"}))
    with pytest.raises(errors.UnknownMethodError, match="observer .*Collector.* has no public async method 'nope'"):
        await client.get_grain(Room, "u").call(forged, "nope")
    with pytest.raises(errors.UnknownMethodError, match="'nope'"):
        await forged.nope()
    with pytest.raises(TypeError, match="no public async method"):
        await client.observer(object())
    with pytest.raises(TypeError, match="instance"):
        await client.observer(Collector)


# --- the reference on the wire -------------------------------------------------------


async def test_a_reference_travels_through_the_codec_and_binds_to_the_receiving_process() -> None:
    sender, receiver = Codec(), Codec()
    made_here = ObserverHub(owner="client:abc", codec=sender, transport=None, call_timeout_s=1.0)
    ObserverHub(owner="127.0.0.1:1@1", codec=receiver, transport=None, call_timeout_s=1.0)
    obs = made_here.create(Collector())
    enc = sender.encode({"subscriber": obs})
    back = receiver.decode(enc.meta, enc.buffers)["subscriber"]
    assert back == obs and back.methods == obs.methods and back.one_way_methods == {"on_note"}
    # Bound to the receiver's hub, which has no way to that client: gone, said by that hub.
    with pytest.raises(errors.ObserverGoneError, match="no network"):
        await back.on_message("x")
    assert sender.copy([obs])[0] is obs  # a value nobody changes: passed as it is on one silo
    # Decoded where no hub is bound (a codec of its own): it decodes, and a call says why it cannot go.
    loose = Codec().decode(enc.meta, enc.buffers)["subscriber"]
    with pytest.raises(errors.CodecError, match="outside a silo or client"):
        await loose.on_message("x")
    with pytest.raises(errors.CodecError, match="observer reference should be"):
        receiver.decode(msgpack.packb(msgpack.ExtType(15, msgpack.packb(["client:abc", 7, [], [], []]))))


# --- the in-process harness ----------------------------------------------------------


async def test_the_in_process_silo_calls_observers_with_the_same_semantics() -> None:
    async with InProcessSilo([Room, Watcher]) as silo:
        handler = Collector()
        obs = silo.observer(handler)
        room = silo.get_grain(Room, "r")
        await room.join(obs)
        assert await room.say("hi") == {"delivered": 1, "gone": [], "failed": {}}
        assert handler.messages == ["hi"]
        # Arguments are copied as for any call on one silo: the handler's append stays its own.
        items = ["mine"]
        assert await obs.append_to(items) == ["mine", "observer"] and items == ["mine"]
        with pytest.raises(errors.GrainTimeoutError):
            await room.tell_slowly(obs, 30.0, 0.1)
        await asyncio.wait_for(handler.cancelled.wait(), 5)
        await obs.dispose()
        assert await room.say("bye") == {"delivered": 0, "gone": [str(obs.observer_id)], "failed": {}}


async def test_the_in_process_cluster_reaches_a_grains_observer_on_another_silo() -> None:
    async with InProcessCluster([Room, Watcher], silos=2) as cluster:
        a, b = cluster.silos
        watcher, room = a.get_grain(Watcher, "w"), a.get_grain(Room, "r")
        await a.router.activate(watcher.grain_id, a.address)
        await a.router.activate(room.grain_id, b.address)
        obs: Any = await watcher.watch("r")
        assert await room.say("over the twin") == {"delivered": 1, "gone": [], "failed": {}}
        assert await watcher.seen() == ["over the twin"]
        assert b.observers.statistics().calls_out == 1
        await a.deactivate(GrainId("Watcher", "w"))
        assert (await room.say("gone now"))["gone"] == [str(obs.observer_id)]
