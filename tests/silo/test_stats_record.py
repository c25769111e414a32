"""A silo's stats record does not grow with the cluster: it names no other silo."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from silo.silo import Silo


async def test_a_stats_record_names_no_other_silo_and_keeps_its_size_as_silos_join(
    cluster: Callable[..., Awaitable[list[Silo]]],
) -> None:
    (first,) = await cluster(1, stats_interval_s=3600.0)
    alone = first.stats_publisher.record()
    others = await cluster(4, stats_interval_s=3600.0)
    await first.view.refresh()
    assert first.view.statistics().active == 5  # it does see them
    rec = first.stats_publisher.record()
    body = rec.model_dump_json()
    for other in others:
        assert str(other.address) not in body and other.address.endpoint not in body
    # The membership figures are counts: every silo's record is O(1), the dashboard's read of all O(n).
    assert rec.components["membership"].keys() == alone.components["membership"].keys()
    assert "members" not in rec.components["membership"]
