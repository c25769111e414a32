"""Prometheus ``/metrics``: a collector over the latest published records.

No global default registry: each app owns a ``CollectorRegistry`` holding one
``ClusterCollector``, so several dashboards (or tests) share a process.

Every figure comes from a record silos or coordinators already published, so
a scrape costs the cluster nothing: counters are the records' own cumulative
counts (a silo's since it started, a job's since this start of it), which
Prometheus' ``rate()`` reads across a restart as a counter reset. A silo
without a GPU publishes none, and the GPU families are then left out of the
text altogether: absent, not zeros. ``docs/dashboard.md`` lists the metrics;
``tests/dashboard/test_promtool.py`` holds the text to ``promtool check metrics``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from dashboard.reader import Snapshot
from grains.serving.records import BATCH_BUCKETS, ModelSummary
from grains.training.api.records import JobProgress
from silo.records.membership import SiloStatus
from silo.records.stats import BUCKETS_MS, dense


class ClusterCollector(Collector):
    """Turns the snapshot the endpoint just read into metric families."""

    def __init__(self, cluster: str) -> None:
        self.cluster = cluster
        self.snapshot: Snapshot | None = None
        self.jobs: list[JobProgress] = []
        self.models: list[ModelSummary] = []
        self.redis_up = False

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "redgrain_redis_up", "1 when the dashboard could read Redis.", labels=["cluster"]
        )
        up.add_metric([self.cluster], 1.0 if self.redis_up else 0.0)
        yield up
        snap = self.snapshot
        if snap is None or not self.redis_up:
            return
        silos = GaugeMetricFamily(
            "redgrain_silos", "Silos per membership status.", labels=["cluster", "status"]
        )
        for status in SiloStatus:
            n = sum(1 for r in snap.members.values() if r.status is status)
            silos.add_metric([self.cluster, status.value], n)
        yield silos

        gauges = {
            "cpu": GaugeMetricFamily(
                "redgrain_silo_cpu_percent", "Process CPU (100 = one core).", labels=["silo"]
            ),
            "rss": GaugeMetricFamily(
                "redgrain_silo_rss_bytes", "Resident memory.", labels=["silo"]
            ),
            "up": GaugeMetricFamily(
                "redgrain_silo_uptime_seconds", "Seconds since the silo started.", labels=["silo"]
            ),
            "act": GaugeMetricFamily(
                "redgrain_activations", "Live activations.", labels=["silo", "grain_type"]
            ),
        }
        transport = CounterMetricFamily("redgrain_transport_bytes", "Bytes moved by a silo's transport.",
                                        labels=["silo", "direction"])  # fmt: skip
        calls = CounterMetricFamily(
            "redgrain_calls", "Grain calls completed.", labels=["grain_type", "method"]
        )
        errs = CounterMetricFamily(
            "redgrain_call_errors", "Grain calls that raised.", labels=["grain_type", "method"]
        )
        gpu_util = GaugeMetricFamily(
            "redgrain_silo_gpu_utilization_ratio",
            "Fraction of the last sample period a GPU was busy, 0..1 (NVML; absent without it).",
            labels=["silo", "gpu"],
        )
        gpu_used = GaugeMetricFamily(
            "redgrain_silo_gpu_memory_used_bytes",
            "GPU memory in use on a silo's device, all processes (NVML; else torch: total - free).",
            labels=["silo", "gpu"],
        )
        gpu_total = GaugeMetricFamily(
            "redgrain_silo_gpu_memory_total_bytes",
            "GPU memory of a silo's device.",
            labels=["silo", "gpu"],
        )
        reminders = {
            "registered": CounterMetricFamily(
                "redgrain_reminders_registered",
                "Reminders registered through a silo.",
                labels=["silo"],
            ),
            "delivered": CounterMetricFamily(
                "redgrain_reminder_ticks_delivered",
                "Reminder ticks whose receive_reminder ran to completion on a silo.",
                labels=["silo"],
            ),
            "failed": CounterMetricFamily(
                "redgrain_reminder_ticks_failed",
                "Reminder ticks whose delivery or receive_reminder failed on a silo.",
                labels=["silo"],
            ),
        }
        # From each silo's ``redis`` statistics (silo/redis_util.py, RedisClientStatistics).
        redis_families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "short_replication": CounterMetricFamily(
                "redgrain_redis_short_replication",
                "State writes and registrations acknowledged with fewer replicas than wait_replicas "
                "(a WAIT that ran short, or a master with no connected replica).",
                labels=["silo"],
            ),
            "replica_less_masters": GaugeMetricFamily(
                "redgrain_redis_replica_less_masters",
                "Masters a silo last saw with fewer connected replicas than wait_replicas.",
                labels=["silo"],
            ),
            "pool_waits": CounterMetricFamily(
                "redgrain_redis_pool_waits",
                "Redis calls that found every connection of a silo's pool in use and waited.",
                labels=["silo"],
            ),
            "pool_exhausted": CounterMetricFamily(
                "redgrain_redis_pool_exhausted",
                "Redis calls that waited the whole pool timeout and failed (pool exhausted).",
                labels=["silo"],
            ),
            "pool_in_use": GaugeMetricFamily(
                "redgrain_redis_pool_in_use", "Redis connections a silo has in use.", labels=["silo"]
            ),
            "pool_size": GaugeMetricFamily(
                "redgrain_redis_pool_size", "Redis connections a silo's pool may open.", labels=["silo"]
            ),
        }
        latency = HistogramMetricFamily("redgrain_call_duration_seconds", "Grain call duration (queueing included).",
                                        labels=["grain_type", "method"])  # fmt: skip
        merged: dict[tuple[str, str], tuple[int, int, float, list[int]]] = {}
        for rec in snap.live_records():
            gauges["cpu"].add_metric([rec.address], rec.cpu_percent)
            gauges["rss"].add_metric([rec.address], rec.rss_bytes)
            gauges["up"].add_metric([rec.address], rec.uptime_s)
            for t, n in sorted(rec.by_type.items()):
                gauges["act"].add_metric([rec.address, t], n)
            tr = rec.components.get("transport", {})
            transport.add_metric([rec.address, "in"], float(tr.get("bytes_in", 0)))
            transport.add_metric([rec.address, "out"], float(tr.get("bytes_out", 0)))
            for gpu in rec.gpus:
                labels = [rec.address, str(gpu.index)]
                if gpu.utilization is not None:
                    gpu_util.add_metric(labels, gpu.utilization)
                gpu_used.add_metric(labels, gpu.memory_used_bytes)
                gpu_total.add_metric(labels, gpu.memory_total_bytes)
            red = rec.components.get("redis", {})
            for field, fam in redis_families.items():
                if isinstance(red.get(field), int | float):
                    fam.add_metric([rec.address], float(red[field]))
            rem = rec.components.get("reminders", {})
            for field, family in reminders.items():
                if isinstance(rem.get(field), int | float):
                    family.add_metric([rec.address], float(rem[field]))
            for x in rec.methods:
                c, e, total, hist = merged.get((x.grain_type, x.method), (0, 0, 0.0, dense({})))
                hist = [a + b for a, b in zip(hist, dense(x.hist), strict=True)]
                merged[(x.grain_type, x.method)] = (
                    c + x.calls,
                    e + x.errors,
                    total + x.total_ms,
                    hist,
                )
        yield from gauges.values()
        yield transport
        # Not even HELP lines without a GPU: absent, not zero.
        yield from (f for f in (gpu_util, gpu_used, gpu_total) if f.samples)
        yield from reminders.values()
        yield from (f for f in redis_families.values() if f.samples)
        for (t, meth), (c, e, total, hist) in sorted(merged.items()):
            calls.add_metric([t, meth], c)
            errs.add_metric([t, meth], e)
            buckets, seen = [], 0
            for bound, n in zip(BUCKETS_MS, hist, strict=False):
                seen += n
                buckets.append((repr(bound / 1000.0), float(seen)))
            buckets.append(("+Inf", float(sum(hist))))
            latency.add_metric([t, meth], buckets, total / 1000.0)
        yield calls
        yield errs
        yield latency

        step = GaugeMetricFamily(
            "redgrain_job_step", "Training step reached.", labels=["job", "status"]
        )
        epoch = GaugeMetricFamily(
            "redgrain_job_epoch", "Passes over the training set so far.", labels=["job"]
        )
        loss = GaugeMetricFamily(
            "redgrain_job_loss", "Latest training loss (mean over trainers).", labels=["job"]
        )
        acc = GaugeMetricFamily(
            "redgrain_job_accuracy",
            "Latest evaluation accuracy on the test split (absent when the evaluation reports none).",
            labels=["job"],
        )
        named = GaugeMetricFamily(
            "redgrain_job_metric",
            "Latest value of a job's metric by name: split=train, the step function's (the loss"
            " included; mean over trainers); split=eval, the latest evaluation on the test split.",
            labels=["job", "split", "name"],
        )
        stale = GaugeMetricFamily(
            "redgrain_job_max_staleness",
            "Largest gradient staleness seen, in steps (async and ssp modes).",
            labels=["job"],
        )
        sps = GaugeMetricFamily(
            "redgrain_job_samples_per_second", "Training throughput.", labels=["job"]
        )
        wire = GaugeMetricFamily(
            "redgrain_job_bytes_per_step", "Bytes on the wire per step.", labels=["job"]
        )
        steps = CounterMetricFamily(
            "redgrain_training_steps",
            "Global training steps a job executed: steps redone after a rollback count again, so it"
            " only grows while the job runs (it starts from 0 when the job id is started again).",
            labels=["job"],
        )
        samples = CounterMetricFamily(
            "redgrain_training_samples",
            "Training samples a job processed (steps x batch size x trainers), redone steps included.",
            labels=["job"],
        )
        for job in self.jobs:
            steps.add_metric([job.job], job.steps_run)
            samples.add_metric([job.job], job.samples_run)
            step.add_metric([job.job, job.status], job.step)
            epoch.add_metric([job.job], job.epoch)
            if job.loss is not None:
                loss.add_metric([job.job], job.loss)
                named.add_metric([job.job, "train", "loss"], job.loss)
            for name, value in sorted(job.metrics.items()):
                if name != "loss" or job.loss is None:  # one sample per label set
                    named.add_metric([job.job, "train", name], value)
            for name, value in sorted(job.eval_metrics.items()):
                named.add_metric([job.job, "eval", name], value)
            if job.accuracy is not None:
                acc.add_metric([job.job], job.accuracy)
            stale.add_metric([job.job], job.max_staleness)
            sps.add_metric([job.job], job.samples_per_s)
            wire.add_metric([job.job], job.bytes_per_step)
        yield from (steps, samples, step, epoch, loss, acc, named, stale, sps, wire)
        yield from model_families(self.models)


def _buckets(hist: list[int], bounds: tuple[float, ...]) -> list[tuple[str, float]]:
    out, seen = [], 0
    for bound, n in zip(bounds, hist, strict=False):
        seen += n
        out.append((repr(float(bound)), float(seen)))
    out.append(("+Inf", float(sum(hist))))
    return out


def model_families(models: list[ModelSummary]) -> Iterator[Metric]:
    """Served models, from their replicas' records (grains/serving/records.py); absent when none."""
    if not models:
        return
    requests = CounterMetricFamily("redgrain_inference_requests", "Predict requests replicas answered (errors included).",
                                   labels=["model", "silo"])  # fmt: skip
    errs = CounterMetricFamily("redgrain_inference_errors", "Predict requests that failed (bad input included).",
                               labels=["model", "silo"])  # fmt: skip
    replicas = GaugeMetricFamily("redgrain_inference_replicas", "Live replicas of a model, by readiness.",
                                 labels=["model", "ready"])  # fmt: skip
    batch = HistogramMetricFamily("redgrain_inference_batch_rows", "Rows per forward pass.", labels=["model"])
    lat = {
        kind: HistogramMetricFamily(f"redgrain_inference_{kind}_seconds", doc, labels=["model"])
        for kind, doc in (("queue", "Wait of a request for its batch."), ("compute", "Forward pass of a request's batch."),
                          ("latency", "A request in its replica: queue + compute."))
    }  # fmt: skip
    for m in models:
        replicas.add_metric([m.name, "true"], m.ready_replicas)
        replicas.add_metric([m.name, "false"], len(m.replicas) - m.ready_replicas)
        hists = {k: [0] * (len(BUCKETS_MS) + 1) for k in lat}
        sums = dict.fromkeys(lat, 0.0)
        for r in m.replicas:
            requests.add_metric([m.name, r.silo], r.requests)
            errs.add_metric([m.name, r.silo], r.errors)
            for k, (h, total) in {"queue": (r.queue_ms, r.queue_ms_sum), "compute": (r.compute_ms, r.compute_ms_sum),
                                  "latency": (r.latency_ms, r.latency_ms_sum)}.items():  # fmt: skip
                hists[k] = [a + b for a, b in zip(hists[k], dense(h), strict=True)]
                sums[k] += total
        rows = sum(r.rows for r in m.replicas)
        batch.add_metric([m.name], _buckets(m.batch_rows, tuple(float(b) for b in BATCH_BUCKETS)), float(rows))
        for k, fam in lat.items():
            fam.add_metric([m.name], _buckets(hists[k], tuple(b / 1000.0 for b in BUCKETS_MS)), sums[k] / 1000.0)
    yield from (requests, errs, replicas, batch, *lat.values())
