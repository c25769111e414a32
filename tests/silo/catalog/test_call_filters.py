"""Call filters configured by import path (settings, ``redgrain silo --incoming-filter``), given
in code, and per grain class; incoming on the callee's silo, outgoing on the caller's side.

The order (pipeline.py): incoming, the silo's stats, code filters, the settings' filters,
then the class's ``@incoming_filter``; outgoing, the class's ``@outgoing_filter``, then the
silo's (or the client's) ``outgoing_filters``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from silo import errors
from silo.client import ClusterClient
from silo.settings import ClientSettings, SiloSettings
from silo.silo import Silo
from silo.testing import InProcessSilo
from tests import extension_grains as eg
from tests.conftest import FAST_MEMBERSHIP
from tests.extension_grains import Echo, Relay

IN = ("tests.extension_grains:Tagging", "tests.extension_grains:second_incoming")
OUT = ("tests.extension_grains:stamping_outgoing",)


@pytest.fixture(autouse=True)
def seen() -> list[tuple[str, str, str | None]]:
    eg.SEEN.clear()
    return eg.SEEN


@pytest.fixture
async def silo(redis_url: str, cluster_name: str) -> AsyncIterator[Silo]:
    settings = SiloSettings(
        redis_url=redis_url,
        cluster=cluster_name,
        grains=("tests.extension_grains",),
        membership=FAST_MEMBERSHIP,
        incoming_filters=IN,
        outgoing_filters=OUT,
    )
    s = await Silo(settings, filters=[eg.code_incoming]).start()
    yield s
    await s.stop(graceful=False)


def _calls(seen: list[tuple[str, str, str | None]], where: str) -> list[str]:
    return [f for f, w, _ in seen if w == where]


async def test_filters_from_settings_see_every_call_in_the_documented_order(silo, client, seen) -> None:
    assert await client.get_grain(Echo, "e").echo("hi") == "[in]hi"
    # Code filter, the settings' two in their order, then Echo's own class filter.
    assert _calls(seen, "Echo.echo") == ["code", "in", "in2", "echo-class"]
    assert ("out", "Echo.echo", None) not in seen  # the silo's outgoing filters are its grains' only


async def test_an_outgoing_filter_sees_a_grain_to_grain_call_and_may_change_it(silo, client, seen) -> None:
    # Relay calls Echo on the same silo: Relay's class filter, then the silo's stamping one,
    # which appends "+out" to the argument; Echo's answer is tagged on the way back, and
    # Relay's answer again.
    assert await client.get_grain(Relay, "r").relay("x") == "[in][in]x+out"
    outgoing = [(f, c) for f, w, c in seen if f in ("relay-class-out", "out")]
    assert outgoing == [("relay-class-out", "Relay/r"), ("out", "Relay/r")]
    # A per-class incoming filter sees only its class: Echo's ran for Echo, not for Relay.
    assert _calls(seen, "Relay.relay") == ["code", "in", "in2"]
    # The call to Echo: out of Relay through the outgoing filters, into Echo through the incoming.
    assert _calls(seen, "Echo.echo") == ["relay-class-out", "out", "code", "in", "in2", "echo-class"]


async def test_a_client_runs_the_outgoing_filters_its_settings_name(silo, redis_url, cluster_name, seen) -> None:
    settings = ClientSettings(redis_url=redis_url, cluster=cluster_name, outgoing_filters=OUT)
    async with await ClusterClient.connect(settings=settings) as client:
        assert await client.get_grain(Echo, "c").echo("c") == "[in]c+out"
    assert ("out", "Echo.echo", None) in seen  # no calling grain: a client


async def test_a_filter_path_that_does_not_resolve_fails_the_start(redis_url, cluster_name) -> None:
    settings = SiloSettings(
        redis_url=redis_url, cluster=cluster_name, grains=("tests.extension_grains",),
        incoming_filters=("tests.extension_grains:NoSuchFilter",),
    )  # fmt: skip
    with pytest.raises(errors.ConfigError, match="incoming filter 'tests.extension_grains:NoSuchFilter'.*has no"):
        await Silo(settings).start()
    with pytest.raises(ValueError, match="not an import path"):
        SiloSettings(outgoing_filters=("no-colon",))


async def test_the_in_process_harness_runs_the_same_filters(seen) -> None:
    async with InProcessSilo(
        [Echo, Relay], filters=[eg.code_incoming, eg.Tagging()], outgoing_filters=[eg.stamping_outgoing]
    ) as s:
        assert await s.get_grain(Relay, "h").relay("y") == "[in][in]y+out"
    assert _calls(seen, "Echo.echo") == ["relay-class-out", "out", "code", "in", "echo-class"]


async def test_redgrain_silo_takes_filters_on_its_command_line(silo_processes, client) -> None:
    silo_processes(
        1,
        grains="tests.extension_grains",
        extra_args=["--incoming-filter", IN[0], "--outgoing-filter", OUT[0]],
    )
    assert await client.get_grain(Relay, "p").relay("p") == "[in][in]p+out"
