"""Grain-type allow-list: a silo hosts only the modules it was started with, and imports nothing on demand."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from silo import errors
from silo.client import ClusterClient
from silo.codec import Codec, TypeRegistry
from silo.messaging.frame import REQUEST
from silo.messaging.transport import Transport
from silo.settings import TransportSettings
from silo.silo import Silo
from tests.helpers import SiloProcess
from tests.security.vault_grains import Vault


async def test_type_lives_only_on_the_silo_started_with_it_and_direct_frames_elsewhere_are_refused(
    cluster: Callable[..., Awaitable[list[Silo]]],
    silo_processes: Callable[..., list[SiloProcess]],
    client: ClusterClient,
    tmp_path: Path,
) -> None:
    mark = tmp_path / "imported.mark"
    (plain,) = silo_processes(1, env={"REDGRAIN_TEST_IMPORT_MARK": str(mark)})
    (vault_silo,) = await cluster(1, grains=("tests.security.vault_grains",))
    await client.refresh()

    # Through the client: placement only considers silos that host the type.
    for i in range(8):
        assert await client.get_grain(Vault, f"v{i}").open() == f"opened on {vault_silo.address}"

    # A hand-made frame sent straight to the silo that does not host it.
    assert plain.address is not None
    transport = Transport(TransportSettings(), Codec(TypeRegistry()))
    try:
        conn = await transport.connect(plain.address.endpoint)
        for type_name in (
            "Vault",
            "Sentinel",
            "tests.security.sentinel_grains:Sentinel",
            "tests.security.sentinel_grains.Sentinel",
            "os:system",
        ):
            header: list[object] = [REQUEST, 0, type_name, "k", "open", 5000, [], 0]
            with pytest.raises(errors.UnknownGrainError, match="not hosted by this silo"):
                await conn.request(header, (), 5.0)
        # The same connection still serves the types the silo does host.
        assert (
            await conn.request([REQUEST, 0, "Echo", "k", "echo", 5000, [], 0], ("ok",), 5.0) == "ok"
        )
    finally:
        await transport.close()
    assert not mark.exists(), f"a frame made the silo import a module: {mark.read_text()}"
    assert plain.alive()
