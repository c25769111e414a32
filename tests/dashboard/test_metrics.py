"""/metrics beyond calls: training counters per job, GPU gauges per silo, and the GPU probe.

The probe reads NVML or torch through two seams (a loader, a module getter), so
its mapping is tested here against stand-ins shaped like ``pynvml`` and
``torch.cuda``; a machine without a GPU takes the real path (no figures).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from grains.training.api.messages import TrainingStatus
from grains.training.api.records import JobProgress, publish_job_progress
from grains.training.progress import job_progress
from silo.client import ClusterClient
from silo.keys import Keys
from silo.records.stats import GpuRecord, SiloStatsRecord
from silo.stats import GpuProbe
from tests.dashboard.conftest import CALM
from tests.sample_grains import Echo

GPU_FAMILIES = (
    "redgrain_silo_gpu_utilization_ratio",
    "redgrain_silo_gpu_memory_used_bytes",
    "redgrain_silo_gpu_memory_total_bytes",
)


async def put_stats_record(redis: aioredis.Redis, keys: Keys, rec: SiloStatsRecord) -> None:
    """Write ``rec`` where the silo's publisher writes its own (stop that one first)."""
    await redis.set(keys.silo_stats(rec.address), rec.model_dump_json())
    await redis.zadd(keys.silo_stats_index, {rec.address: rec.at})


def families(api: TestClient) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(api.get("/metrics").text)}


def no_gpu() -> GpuProbe:
    return GpuProbe(nvml=lambda: None, torch=lambda: None)


# --- training counters -----------------------------------------------------------------


async def test_training_counters_are_per_job_and_named_total(
    api: TestClient, redis_url: str, cluster_name: str
) -> None:
    keys = Keys(cluster_name)
    r = aioredis.Redis.from_url(redis_url)
    # A rollback from step 30 to 20: the step goes back, the counters keep growing.
    for step, run in ((30, 30.0), (20, 31.0), (25, 36.0)):
        await publish_job_progress(r, keys, JobProgress(
            job="a", step=step, steps_run=run, samples_run=int(run) * 64,
        ))  # fmt: skip
        fam = families(api)
        steps = {s.labels["job"]: s.value for s in fam["redgrain_training_steps"].samples
                 if s.name == "redgrain_training_steps_total"}  # fmt: skip
        assert steps == {"a": run}
    await publish_job_progress(
        r, keys, JobProgress(job="b", step=3, steps_run=3.5, samples_run=224)
    )
    await r.aclose()

    fam = families(api)
    samples = {s.labels["job"]: s.value for s in fam["redgrain_training_samples"].samples
               if s.name == "redgrain_training_samples_total"}  # fmt: skip
    assert samples == {"a": 36 * 64, "b": 224}
    assert fam["redgrain_training_steps"].type == "counter"
    assert "rollback" in fam["redgrain_training_steps"].documentation


def test_a_job_record_carries_the_coordinators_counters() -> None:
    st = TrainingStatus(job="j", status="running", step=20, steps_run=31.5, samples_run=2016)
    progress = job_progress(st, None, [], [])
    assert (progress.steps_run, progress.samples_run) == (31.5, 2016)
    # Records from before the counters parse with zeros.
    assert JobProgress.model_validate_json('{"job": "old", "step": 4}').steps_run == 0.0


# --- GPU gauges ------------------------------------------------------------------------------


async def test_a_silo_without_gpus_shows_no_gpu_series(
    cluster, client: ClusterClient, api: TestClient, cluster_name: str
) -> None:
    (silo,) = await cluster(1, membership=CALM, stats_interval_s=3600.0)
    await client.get_grain(Echo, "e").echo(1)
    await silo.stats_publisher.stop()
    rec = silo.stats_publisher.record().model_copy(update={"gpus": no_gpu().sample()})
    assert rec.gpus == []
    await put_stats_record(silo.redis, Keys(cluster_name), rec)

    text = api.get("/metrics").text
    assert "redgrain_silo_rss_bytes{" in text  # the record was read
    assert not any(name in text for name in GPU_FAMILIES)  # not even a HELP line


async def test_gpu_figures_of_a_stats_record_are_gauges_per_silo_and_gpu(
    cluster, api: TestClient, cluster_name: str
) -> None:
    (silo,) = await cluster(1, membership=CALM, stats_interval_s=3600.0)
    await silo.stats_publisher.stop()
    gpus = [
        GpuRecord(index=0, name="H200", source="nvml", utilization=0.5,
                  memory_used_bytes=10 << 30, memory_total_bytes=141 << 30),
        GpuRecord(index=1, name="H200", source="torch", memory_used_bytes=2 << 30,
                  memory_total_bytes=141 << 30),
    ]  # fmt: skip
    rec = silo.stats_publisher.record().model_copy(update={"gpus": gpus})
    await put_stats_record(silo.redis, Keys(cluster_name), rec)

    fam = families(api)

    def by_gpu(name: str) -> dict[tuple[str, str], float]:
        return {(s.labels["silo"], s.labels["gpu"]): s.value for s in fam[name].samples}

    me = str(silo.address)
    assert by_gpu("redgrain_silo_gpu_utilization_ratio") == {(me, "0"): 0.5}  # unknown is absent
    assert by_gpu("redgrain_silo_gpu_memory_used_bytes") == {
        (me, "0"): 10 << 30,
        (me, "1"): 2 << 30,
    }
    assert by_gpu("redgrain_silo_gpu_memory_total_bytes") == {
        (me, "0"): 141 << 30,
        (me, "1"): 141 << 30,
    }


async def test_short_replication_and_pool_waits_are_counters_per_silo(
    cluster, api: TestClient, cluster_name: str
) -> None:
    (silo,) = await cluster(1, membership=CALM, stats_interval_s=3600.0)
    await silo.stats_publisher.stop()
    rec = silo.stats_publisher.record()
    assert rec.components["redis"]["pool_size"] > 0  # the silo publishes its client's figures
    figures = {"short_replication": 7, "pool_waits": 3, "pool_exhausted": 1, "replica_less_masters": 1}
    comps = {**rec.components, "redis": {**rec.components["redis"], **figures}}
    await put_stats_record(silo.redis, Keys(cluster_name), rec.model_copy(update={"components": comps}))

    fam = families(api)
    me = str(silo.address)

    def value(name: str, sample: str) -> dict[str, float]:
        return {s.labels["silo"]: s.value for s in fam[name].samples if s.name == sample}

    assert value("redgrain_redis_short_replication", "redgrain_redis_short_replication_total") == {me: 7}
    assert value("redgrain_redis_pool_waits", "redgrain_redis_pool_waits_total") == {me: 3}
    assert value("redgrain_redis_pool_exhausted", "redgrain_redis_pool_exhausted_total") == {me: 1}
    assert value("redgrain_redis_replica_less_masters", "redgrain_redis_replica_less_masters") == {me: 1}


# --- the probe ----------------------------------------------------------------------------


class NVMLError(Exception):
    pass


def fake_nvml(devices: list[dict[str, Any]]) -> SimpleNamespace:
    """What the probe uses of ``pynvml``; a device without ``util`` answers NVMLError (a MIG slice)."""

    def utilization(h: dict[str, Any]) -> SimpleNamespace:
        if "util" not in h:
            raise NVMLError("Not Supported")
        return SimpleNamespace(gpu=h["util"], memory=0)

    return SimpleNamespace(
        NVMLError=NVMLError,
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=lambda i: devices[i],
        nvmlDeviceGetUUID=lambda h: h["uuid"],
        nvmlDeviceGetName=lambda h: h["name"].encode(),  # older bindings answer bytes
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=h["used"], total=80 << 30, free=0),
        nvmlDeviceGetUtilizationRates=utilization,
    )


DEVICES = [
    {"uuid": "GPU-aaaa-1", "name": "A100", "used": 1 << 30, "util": 40},
    {"uuid": "GPU-bbbb-2", "name": "A100", "used": 2 << 30},
    {"uuid": "GPU-cccc-3", "name": "A100", "used": 3 << 30, "util": 0},
]


def test_nvml_figures_are_ratios_and_bytes_and_unknown_utilization_stays_unknown() -> None:
    loads: list[int] = []

    def load() -> SimpleNamespace:
        loads.append(1)
        return fake_nvml(DEVICES)

    probe = GpuProbe(nvml=load, torch=lambda: None)
    gpus = probe.sample()
    assert [(g.index, g.name, g.source, g.utilization, g.memory_used_bytes) for g in gpus] == [
        (0, "A100", "nvml", 0.4, 1 << 30),
        (1, "A100", "nvml", None, 2 << 30),
        (2, "A100", "nvml", 0.0, 3 << 30),  # idle is 0, not unknown
    ]
    assert probe.sample() == gpus and loads == [1]  # NVML is loaded once


@pytest.mark.parametrize(
    ("visible", "indices"),
    [("2,0", [0, 2]), ("GPU-bbbb", [1]), ("1,-1,2", [1]), ("", [])],
)
def test_nvml_devices_follow_cuda_visible_devices(visible: str, indices: list[int]) -> None:
    probe = GpuProbe(nvml=lambda: fake_nvml(DEVICES), torch=lambda: None, visible_devices=visible)
    assert [g.index for g in probe.sample()] == indices


class FakeCuda:
    """``torch.cuda`` as the probe reads it; records which devices were asked for free memory."""

    def __init__(self, initialized: bool, reserved: list[int]) -> None:
        self.initialized = initialized
        self.reserved = reserved
        self.asked: list[int] = []

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return len(self.reserved)

    def memory_reserved(self, i: int) -> int:
        return self.reserved[i]

    def mem_get_info(self, i: int) -> tuple[int, int]:
        self.asked.append(i)
        return (60 << 30, 80 << 30)

    def get_device_name(self, i: int) -> str:
        return "H100"


def test_torch_figures_only_for_devices_this_process_already_uses() -> None:
    cuda = FakeCuda(initialized=True, reserved=[0, 4 << 20])
    gpus = GpuProbe(nvml=lambda: None, torch=lambda: SimpleNamespace(cuda=cuda)).sample()
    assert [
        (g.index, g.source, g.utilization, g.memory_used_bytes, g.memory_total_bytes) for g in gpus
    ] == [(1, "torch", None, 20 << 30, 80 << 30)]
    assert cuda.asked == [1]  # device 0 was never touched: no context made there


def test_no_torch_or_cuda_unused_means_no_figures() -> None:
    cuda_unused = FakeCuda(initialized=False, reserved=[4 << 20])
    assert GpuProbe(nvml=lambda: None, torch=lambda: None).sample() == []
    assert (
        GpuProbe(nvml=lambda: None, torch=lambda: SimpleNamespace(cuda=cuda_unused)).sample() == []
    )
    assert cuda_unused.asked == []


def test_a_failing_driver_costs_the_record_its_gpus_only() -> None:
    def broken(h: dict[str, Any]) -> None:
        raise NVMLError("GPU is lost")

    nvml = fake_nvml(DEVICES)
    nvml.nvmlDeviceGetMemoryInfo = broken
    assert GpuProbe(nvml=lambda: nvml, torch=lambda: None).sample() == []
