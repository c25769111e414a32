"""Pipeline parallelism: efficiency against the GPipe bound, and pipeline vs data parallel.

``python -m benchmarks pipeline [--quick]``. Two silo processes (a third joins for the
recovery row), one torch thread each.

**Efficiency.** With ``p`` stages of equal cost ``t`` per micro-batch (forward
plus backward), a GPipe step of ``m`` micro-batches takes at least ``(m + p -
1) t``, while each stage is busy ``m t`` of it: the bound on a stage's busy
share is ``m / (m + p - 1)``. The model here is built so its two stages cost
the same (an ``nn.Sequential`` of equal ``Linear(1024, 1024)`` + ``ReLU``
blocks, cut in the middle), and the figure is read per stage: the stage's
measured busy time per step (``m`` x its mean forward + backward time per
micro-batch, as the stage times them) over the measured step time (from the
coordinator's per-tick history of steps and times, from 20% of the steps to
the last tick before the end). The busiest stage is the one the bound
describes (the other waits on it), so the efficiency is its share. On this 2-core
host each stage has a core to itself, so the overlap is real; what the
figure loses against the bound is the calls between stages, stage 0's own
batch gathering and the update at the end of each step.

**Recovery.** SIGKILL of the silo of stage 1 of a 2-stage job on 3 silos
(the coordinator on the third): the time from the kill to the pipeline's
next committed step (failure detection, the rollback of every stage to the
last committed checkpoint, stage 1 re-activated on a survivor, one step),
and the steps redone. The same figures as ``bench_training``'s
parameter-server rows (:func:`benchmarks.training_recovery.pipeline_recovery`).

**Pipeline vs data parallel.** The same model and batch on the same two
silos: pipeline (2 stages, 8 micro-batches) against sync data parallel (2
trainers, 2 shards). On one host with enough memory for the whole model on
each silo, data parallelism is the faster choice; pipeline parallelism
trades that speed for memory (each stage holds half the parameters, their
gradients and optimizer state).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from benchmarks.common import (
    BenchCluster,
    fix_torch_threads,
    machine_facts,
    print_header,
    print_table,
    ratio,
    run,
    write_result,
)
from benchmarks.training_recovery import pipeline_recovery

MODEL: dict[str, Any] = {
    "model": "grains.training.models:mlp",
    "model_args": {"in_features": 1024, "hidden": [1024, 1024, 1024, 1024], "classes": 1024},
    "dataset": "grains.training.datasets:synthetic",
    "dataset_args": {"samples": 8192, "test_samples": 256, "features": 1024, "classes": 10},
    "optimizer": "momentum",
    "lr": 0.01,
    "checkpoint_every": 0,
}
# Quick mode: the same layers and cut at a quarter of the width, on a smaller data set.
QUICK_MODEL: dict[str, Any] = {
    **MODEL,
    "model_args": {"in_features": 256, "hidden": [256, 256, 256, 256], "classes": 256},
    "dataset_args": {"samples": 1024, "test_samples": 256, "features": 256, "classes": 10},
}


async def run_job(client: Any, name: str, model: dict[str, Any], steps: int, **kw: Any) -> dict[str, Any]:
    from grains.training import CoordinatorGrain, TrainingJob

    spec = TrainingJob(**{**model, "steps": steps, **kw})
    coord = client.get_grain(CoordinatorGrain, name)
    await coord.start(spec)
    stages: list[Any] = []
    while True:
        st = await coord.status()
        if st.stages:
            stages = st.stages
        if st.status in ("completed", "failed", "cancelled"):
            break
        await asyncio.sleep(0.1)
    if st.status != "completed":
        raise RuntimeError(f"job {name} {st.status}: {st.error}")
    # Step time from the coordinator's history (a training point per step), from 20% of the steps to the
    # last tick before the end: the job's final checkpoint, evaluation and release are not steps.
    points = [h for h in await coord.history() if h.eval_metrics is None and steps // 5 <= h.step < steps]
    if len(points) >= 2 and points[-1].step > points[0].step:
        step_s = (points[-1].at - points[0].at) / (points[-1].step - points[0].step)
    else:
        step_s = st.elapsed_s / steps
    trainers = int(kw.get("trainers", 1)) if kw.get("mode") != "pipeline" else 1
    return {"step_ms": 1000 * step_s, "samples_per_s": spec.batch_size * trainers / step_s,
            "stages": [{"silo": g.silo, "forward_ms": g.forward_ms, "backward_ms": g.backward_ms} for g in stages]}  # fmt: skip


async def measure(quick: bool) -> dict[str, Any]:
    from silo.client import ClusterClient

    steps, batch = (6, 64) if quick else (60, 256)
    model = QUICK_MODEL if quick else MODEL
    out: dict[str, Any] = {"efficiency": {}, "batch_size": batch}
    with BenchCluster(2, grains="grains.training") as bc:
        async with await ClusterClient.connect(bc.redis_url, cluster=bc.cluster) as client:
            await client.refresh()
            for m in (1, 8) if quick else (1, 4, 8):
                r = await run_job(client, f"pipe-m{m}", model, steps, mode="pipeline", trainers=1, stages=2,
                                  microbatches=m, schedule="gpipe", batch_size=batch)  # fmt: skip
                busy = [m * (g["forward_ms"] + g["backward_ms"]) / r["step_ms"] for g in r["stages"]]
                r["busy"] = busy
                r["efficiency"] = max(busy, default=0.0)  # the busiest stage: the one the bound describes
                r["bound"] = m / (m + 2 - 1)
                out["efficiency"][m] = r
            out["pipeline 2x8 1f1b"] = await run_job(client, "pipe-1f1b", model, steps, mode="pipeline", trainers=1, stages=2,
                                                      microbatches=8, schedule="1f1b", batch_size=batch)  # fmt: skip
            out["data parallel 2x"] = await run_job(client, "dp", model, steps, mode="sync", trainers=2, shards=2,
                                                     batch_size=batch // 2)  # fmt: skip
            # Recovery on the same cluster with a third silo (pipeline_recovery waits for the view).
            rec_spec, kill_at = recovery_spec(quick)
            out["recovery"] = {**rec_spec, "kill_at_step": kill_at}
            bc.add_silo()
            out["recovery"]["stage"] = await pipeline_recovery(client, bc, rec_spec, kill_at)
    return out


def recovery_spec(quick: bool) -> tuple[dict[str, Any], int]:
    """The recovery run: the digits MLP with two hidden layers in 2 stages, killed a third of the way in."""
    steps, every = (90, 15) if quick else (600, 50)
    spec = {"model_args": {"hidden": [64, 64]}, "batch_size": 32, "microbatches": 4, "optimizer": "momentum",
            "lr": 0.05, "steps": steps, "checkpoint_every": every}  # fmt: skip
    return spec, steps // 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks pipeline")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a quarter of the width, m = 1 and 8): checks the benchmark runs")
    args = parser.parse_args(argv)
    fix_torch_threads()
    facts = machine_facts()
    print_header("pipeline: efficiency vs the GPipe bound, pipeline vs data parallel", facts, args.quick)
    results = run(measure(args.quick))
    print("\n## efficiency, 2 stages of equal cost, GPipe (a stage's busy share of the step)")
    table = []
    for m, r in results["efficiency"].items():
        table.append([m, f"{r['step_ms']:.1f}", " / ".join(f"{b:.2f}" for b in r["busy"]), f"{r['efficiency']:.2f}",
                      f"{r['bound']:.2f}", f"{r['efficiency'] / r['bound']:.2f}x"])  # fmt: skip
    print_table(["micro-batches", "ms/step", "busy share per stage", "efficiency", "bound m/(m+p-1)", "of bound"], table)
    eight = results["efficiency"][8]
    print(f"at m = 8: {eight['efficiency'] / eight['bound']:.0%} of the bound (goal: within 15%, i.e. at least 85%)")
    pipe, dp = results["efficiency"][8], results["data parallel 2x"]
    print("\n## pipeline vs data parallel, same model and global batch, 2 silos")
    print_table(["run", "samples/s", "ms/step", "vs data parallel"], [
        ["pipeline, 2 stages, 8 micro-batches, gpipe", f"{pipe['samples_per_s']:,.0f}", f"{pipe['step_ms']:.1f}",
         ratio(pipe["samples_per_s"], dp["samples_per_s"])],
        ["pipeline, 2 stages, 8 micro-batches, 1f1b", f"{results['pipeline 2x8 1f1b']['samples_per_s']:,.0f}",
         f"{results['pipeline 2x8 1f1b']['step_ms']:.1f}",
         ratio(results["pipeline 2x8 1f1b"]["samples_per_s"], dp["samples_per_s"])],
        ["data parallel, 2 trainers, 2 shards, sync", f"{dp['samples_per_s']:,.0f}", f"{dp['step_ms']:.1f}", "1.00x"],
    ])  # fmt: skip
    print("on one host with memory for the whole model on each silo, data parallelism is the faster choice;"
          " pipeline parallelism trades speed for memory (each stage holds half the parameters and their state)")
    rec = results["recovery"]
    r = rec["stage"]
    print(f"\n## recovery: SIGKILL of a stage's silo (digits MLP, 2 stages, 3 silos, {rec['steps']} steps,"
          f" checkpoint every {rec['checkpoint_every']}, killed after step {rec['kill_at_step']})")  # fmt: skip
    print_table(["silo killed", "kill -> next committed step", "detected after", "steps redone", "accuracy"], [
        [f"stage {r['stage']}'s", f"{r['recovery_s']:.2f} s", f"{r['detected_s']:.2f} s", str(r["lost_steps"]),
         f"{(r['accuracy'] or 0):.2%}"],
    ])  # fmt: skip
    print(f"pipeline recovery {r['recovery_s']:.2f} s (goal: at most 3 s), steps redone {r['lost_steps']}"
          f" (at most one checkpoint interval, {rec['checkpoint_every']})")
    write_result("pipeline", {"machine": facts, "quick": args.quick, "results": results})
    return 0
