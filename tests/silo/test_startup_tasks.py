"""``@on_silo_start``: run once the silo is Active and before it reports ready; a task that
fails or runs past ``startup_timeout_s`` fails the start, and the silo leaves the cluster."""

from __future__ import annotations

import pytest

from silo import errors
from silo.cluster.membership import RedisMembershipTable
from silo.records.membership import SiloStatus
from silo.redis_util import connect_redis
from silo.settings import SiloSettings
from silo.silo import Silo, SiloState
from silo.testing import SiloStartError
from tests import extension_grains as eg
from tests.conftest import FAST_MEMBERSHIP
from tests.extension_grains import BootLog


async def test_a_startup_task_has_run_when_a_silo_process_reports_ready(silo_processes, client) -> None:
    (proc,) = silo_processes(1, grains="tests.extension_grains")
    # Read at once after the ready file: the task's grain call (on this same silo) is done.
    assert await client.get_grain(BootLog, "boot").entries() == [f"started {proc.address}"]
    assert "startup task tests.extension_grains:record_boot" in proc.output()


async def test_tasks_run_in_definition_order_with_or_without_a_silo_parameter(cluster, client) -> None:
    eg.SEEN.clear()
    (silo,) = await cluster(1, grains=("tests.extension_grains",))
    assert await client.get_grain(BootLog, "boot").entries() == [f"started {silo.address}"]
    assert eg.SEEN.count(("startup", "second_task", None)) == 1


def test_a_failing_startup_task_stops_the_silo_process_with_a_clear_error(silo_processes) -> None:
    with pytest.raises(SiloStartError) as info:
        silo_processes(1, grains="tests.failing_startup_grains", env={"RG_TEST_STARTUP": "raise"})
    text = str(info.value)
    assert "exited with code 1" in text
    assert (
        "startup task tests.failing_startup_grains:check_config failed, so the silo did not start:"
        " RuntimeError: the catalogue database is unreachable"
    ) in text


async def test_a_startup_task_past_its_timeout_fails_the_start_and_the_silo_leaves(
    redis_url, cluster_name, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RG_TEST_STARTUP", "hang")
    settings = SiloSettings(
        redis_url=redis_url, cluster=cluster_name, grains=("tests.failing_startup_grains",),
        membership=FAST_MEMBERSHIP, startup_timeout_s=0.3,
    )  # fmt: skip
    silo = Silo(settings)
    with pytest.raises(errors.StartupTaskError, match="still running after startup_timeout_s=0.3") as info:
        await silo.start()
    assert info.value.task == "tests.failing_startup_grains:check_config"
    assert silo.status is SiloState.STOPPED
    # It had joined (tasks run once it is Active); the failed start unwound its row to Dead.
    redis = connect_redis(redis_url)
    try:
        _, rows = await RedisMembershipTable(redis, silo.keys).read_all()
    finally:
        await redis.aclose()
    assert [r.status for r in rows.values()] == [SiloStatus.DEAD]
