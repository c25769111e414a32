"""Same-host peers talk over a Unix socket found by the silo's endpoint; anything else uses TCP.

The fast path may only ever fall back: a stale socket file (its silo gone), a
silo that does not offer one, or a side that turned it off all leave the call
working over TCP.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch

from silo.client import ClusterClient
from silo.messaging import local_socket
from silo.settings import ClientSettings, TransportSettings
from silo.silo import Silo
from tests.sample_grains import Echo

ClusterFactory = Callable[..., Awaitable[list[Silo]]]


def peer_of(client: ClusterClient, silo: Silo) -> str:
    assert silo.address is not None
    conn = client.transport.connection_nowait(silo.address.endpoint)
    assert conn is not None
    return conn.peer


async def test_a_client_on_the_same_host_uses_the_silos_unix_socket_which_goes_with_the_silo(
    cluster: ClusterFactory, client: ClusterClient
) -> None:
    (silo,) = await cluster(1)
    assert silo.address is not None
    path = local_socket.socket_path(silo.address.endpoint)
    assert path is not None and path.exists()
    t = torch.randn(1 << 20)  # 4 MB: bigger than the default socket buffers
    back = await client.get_grain(Echo, "local").echo(t)
    assert torch.equal(back, t)
    assert peer_of(client, silo) == str(path)
    await silo.stop()
    assert not path.exists()


async def test_silos_in_one_process_call_each_other_over_their_unix_sockets(
    cluster: ClusterFactory, client: ClusterClient
) -> None:
    a, b = await cluster(2)
    for s in (a, b):
        await s.view.refresh()
    assert a.address is not None and b.address is not None
    assert await a.refs.get_grain(Echo, "on-any").echo("hello") == "hello"
    conn = a.transport.connection_nowait(b.address.endpoint) or await a.transport.connect(b.address.endpoint)
    assert conn.peer == str(local_socket.socket_path(b.address.endpoint))


def stale_socket(path: Path) -> None:
    """A socket file with nobody listening: what a SIGKILLed silo leaves behind."""
    local_socket.prepare(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()


async def test_a_stale_socket_file_is_passed_over_for_tcp(cluster: ClusterFactory, client: ClusterClient) -> None:
    (silo,) = await cluster(1, transport=TransportSettings(local_sockets=False))
    assert silo.address is not None
    path = local_socket.socket_path(silo.address.endpoint)
    assert path is not None and not path.exists()  # turned off: the silo offers none
    stale_socket(path)
    try:
        assert await client.get_grain(Echo, "stale").echo("over tcp") == "over tcp"
        assert peer_of(client, silo) == silo.address.endpoint
    finally:
        path.unlink(missing_ok=True)


async def test_a_client_that_turned_it_off_uses_tcp(cluster: ClusterFactory, redis_url: str, cluster_name: str) -> None:
    (silo,) = await cluster(1)
    assert silo.address is not None
    settings = ClientSettings(transport=TransportSettings(local_sockets=False))
    async with await ClusterClient.connect(redis_url, cluster=cluster_name, settings=settings) as c:
        assert await c.get_grain(Echo, "tcp").echo("over tcp") == "over tcp"
        assert peer_of(c, silo) == silo.address.endpoint


def test_the_socket_directory_is_private_and_per_network_namespace() -> None:
    path = local_socket.socket_path("127.0.0.1:7000")
    assert path is not None
    assert path.parent.name.startswith("net-") and path.parent.parent.name.startswith("redgrain-")
    local_socket.prepare(path)
    assert path.parent.stat().st_mode & 0o077 == 0
    assert local_socket.socket_path(f"{'h' * 200}:7000") is None  # too long for a socket address


async def test_a_starting_silo_removes_sockets_that_killed_silos_left_behind(cluster: ClusterFactory) -> None:
    left = local_socket.socket_path("127.0.0.1:1")  # no silo can have advertised port 1 here
    assert left is not None
    stale_socket(left)
    (live,) = await cluster(1)
    assert live.address is not None
    (_,) = await cluster(1)  # its sweep must keep the live silo's socket
    assert not left.exists()
    live_path = local_socket.socket_path(live.address.endpoint)
    assert live_path is not None and live_path.exists()
