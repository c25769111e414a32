"""Training throughput, bytes on the wire and accuracy: redgrain vs a plain torch loop.

``python -m benchmarks training [--quick]``. Every process at one torch thread.
Two configurations: small (MLP on digits, batch 64) and medium (synthetic
784 -> 1024 -> 1024 -> 10, batch 256). Rows: a plain single-process loop;
redgrain with 1 trainer and its shard on 1 silo; 2 trainers on 2 silos (sync,
async, allreduce) beside torchrun + DDP with 2 workers on the same model; 4
trainers on 2 silos (sync); final accuracy of each; recovery from SIGKILL of a
trainer (allreduce re-forming its group vs torchrun restarting from a
checkpoint, benchmarks/training_allreduce.py); the cost of a trainer beside a
plain loop (issue 38's goals: the fixed per-step cost on the small MLP, 1
trainer vs the plain loop on the tiny BERT, a joining trainer's first step, an
all-reduce group's forming; benchmarks/training_cost.py, alone with ``--cost``);
with ``--census`` alone, that cost as counts per step that do not move with the
machine's load (benchmarks/step_census.py).
Samples/s are measured between 20% of the steps and the end (startup excluded).
Ray's parameter-server pattern (one PS actor, 1 or 2 worker actors, sync) runs
the same models and batches when ray is installed (benchmarks/ray_training.py).
"plain loop, 2 processes at once" is the ceiling for every row with 2 or more
trainers: two independent loops with no communication, on the same cores (this
machine has 2; 4 trainers on 2 silos share them, two to a core).

Two tables per configuration are read off the same rows:

- communication (2 trainers, 2 shards, 2 silos, sync) for none / fp16 /
  topk:0.01 / topk:0.01:fp16: bytes per step (gradients pushed plus parameters
  pulled, all trainers) and the exchange time per step, which is the step time
  of the row minus the compute of one step: the plain loop's CPU time per step
  (its thread's CPU time, so other processes on the machine do not inflate it;
  the two trainers compute their steps in parallel, one per core). That is
  everything a step costs beyond the forward, backward and optimizer step:
  compressing and decompressing, encoding, the transport, the shards' sum, and
  the wait for the slower trainer; it bounds the time on the wire from above.
  Beside it, "waited ms/step" is what the trainers themselves timed
  (``TrainingStatus.exchange_ms_per_step``: a step's wait for the shards'
  replies after its compute, mean over trainers). Wall-clock step times still
  grow with the machine's load (the header prints it).
- scaling (sync): 1 trainer on 1 silo, 2 on 2, 4 on 2; samples/s, the ratio to
  1 trainer, and the share of the ceiling reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

from benchmarks import training_cost
from benchmarks.common import (
    BenchCluster,
    fix_torch_threads,
    machine_facts,
    print_header,
    print_table,
    ratio,
    run,
    start_subprocess,
    write_result,
)
from benchmarks.ray_training import ray_parameter_server
from benchmarks.training_allreduce import redgrain_recovery, torchrun_ddp_phases
from benchmarks.training_recovery import ps_recovery

CONFIGS: dict[str, dict[str, Any]] = {
    "small": {"model": "grains.training.models:mlp", "dataset": "grains.training.datasets:digits", "batch_size": 64},
    "medium": {
        "model": "grains.training.models:medium_mlp",
        "dataset": "grains.training.datasets:synthetic",
        "dataset_args": {"samples": 16384, "test_samples": 2048, "features": 784, "spread": 1.5},
        "batch_size": 256,
    },
}
COMMON: dict[str, Any] = {"optimizer": "momentum", "lr": 0.05, "checkpoint_every": 0, "eval_every": 0}
# Checkpoints are measured at a short interval, where their cost stands well above the
# run-to-run spread of a row (±3-5% here), and scaled to the default interval.
CKPT_EVERY = 10
CKPT = f"2 trainers, 2 silos, sync, checkpoint every {CKPT_EVERY}"
# The communication table's rows: each compression kind on the 2-trainer sync job.
COMPRESSIONS = ("none", "fp16", "topk:0.01", "topk:0.01:fp16")
SYNC2 = "2 trainers, 2 silos, sync"
SCALING = {1: "1 trainer, 1 silo", 2: SYNC2, 4: "4 trainers, 2 silos, sync"}


def comm_label(compression: str) -> str:
    return SYNC2 if compression == "none" else f"{SYNC2}, {compression}"


def default_checkpoint_every() -> int:
    """The job spec's default checkpoint interval, the one the checkpoint-cost goal is read at."""
    from grains.training.api.job import TrainingJob

    return int(TrainingJob.model_fields["checkpoint_every"].default)


def plain_loop(cfg: dict[str, Any], steps: int) -> dict[str, Any]:
    """The baseline: one process, one model, torch's optimizer, the same batches."""
    import torch
    import torch.nn.functional as F

    from grains.training.api.job import TrainingJob
    from grains.training.data.batches import Batches
    from grains.training.datasets import load_dataset
    from grains.training.models import build_model
    from grains.training.strategies.ps.shard import make_optimizer

    spec = TrainingJob(**cfg, **COMMON, steps=steps, trainers=1)
    model = build_model(spec)
    opt = make_optimizer(list(model.parameters()), spec)
    data = Batches(load_dataset(spec, "train"))
    warm = max(1, steps // 5)
    start = cpu = 0.0
    for t in range(steps):
        if t == warm:
            start, cpu = time.perf_counter(), time.thread_time()
        x, y = data.batch(spec.batch_size, 1, 0, t, spec.seed)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
    tx, ty = Batches(load_dataset(spec, "test")).all()
    with torch.no_grad():
        acc = float((model(tx).argmax(1) == ty).float().mean())
    return {"samples_per_s": (steps - warm) * spec.batch_size / elapsed, "step_ms": 1000 * elapsed / (steps - warm),
            "cpu_ms": 1000 * cpu / (steps - warm), "accuracy": acc, "bytes_per_step": 0}  # fmt: skip


PAIR = "plain loop, 2 processes at once"
_PAIR_CHILD = """
import json, sys
from benchmarks.common import fix_torch_threads
fix_torch_threads()
from benchmarks.bench_training import plain_loop
args = json.loads(sys.stdin.readline())
print("ready", flush=True)
sys.stdin.readline()
print(json.dumps(plain_loop(args["cfg"], args["steps"])), flush=True)
"""


def plain_pair(cfg: dict[str, Any], steps: int) -> dict[str, Any]:
    """Two plain loops in two processes, started together: what this machine gives two
    independent trainers with no communication at all (the ceiling for 2-trainer rows)."""
    procs = [start_subprocess(["-c", _PAIR_CHILD]) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write(json.dumps({"cfg": cfg, "steps": steps}) + "\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.close()
        outs = [json.loads(p.stdout.read().strip().splitlines()[-1]) for p in procs if p.stdout is not None]
    finally:
        for p in procs:
            if p.wait(600) != 0:
                raise RuntimeError(f"plain loop process exited {p.returncode}")
    return {"samples_per_s": sum(o["samples_per_s"] for o in outs), "step_ms": max(o["step_ms"] for o in outs),
            "accuracy": outs[0]["accuracy"], "bytes_per_step": 0}  # fmt: skip


async def run_job(client: Any, name: str, cfg: dict[str, Any], steps: int, **kw: Any) -> dict[str, Any]:
    from grains.training import CoordinatorGrain, TrainingJob

    spec = TrainingJob(**{**cfg, **COMMON, "steps": steps, **kw})
    coord = client.get_grain(CoordinatorGrain, name)
    await coord.start(spec)
    trainers = int(kw.get("trainers", 1))
    mark: tuple[float, int] | None = None
    while True:
        st = await coord.status()
        now = time.perf_counter()
        if mark is None and st.step >= steps // 5:
            mark = (now, st.step)
        if st.status in ("completed", "failed", "cancelled"):
            break
        await asyncio.sleep(0.05)
    if st.status != "completed":
        raise RuntimeError(f"job {name} {st.status}: {st.error}")
    t0, s0 = mark or (now, 0)
    rate = (steps - s0) * spec.batch_size * trainers / max(1e-9, now - t0)
    return {"samples_per_s": rate, "step_ms": 1000 * (now - t0) / max(1, steps - s0), "accuracy": st.accuracy,
            "bytes_per_step": st.bytes_per_step, "waited_ms": getattr(st, "exchange_ms_per_step", 0.0)}  # fmt: skip


async def measure(quick: bool) -> dict[str, Any]:
    from silo.client import ClusterClient

    steps = {"small": 600, "medium": 5 if quick else 200}
    # Quick mode runs the medium configuration only: the small one takes the same code paths
    # (and its model and data still train in the recovery rows, which use it in both modes).
    configs = {"medium": _quick(CONFIGS["medium"])} if quick else dict(CONFIGS)
    out: dict[str, Any] = {}
    for name, cfg in configs.items():
        out[name] = {"plain": await asyncio.to_thread(plain_loop, cfg, steps[name])}
        out[name][PAIR] = await asyncio.to_thread(plain_pair, cfg, steps[name])
    with BenchCluster(1, grains="grains.training") as bc:
        async with await ClusterClient.connect(bc.redis_url, cluster=bc.cluster) as client:
            for name, cfg in configs.items():
                n = steps[name]
                out[name]["1 trainer, 1 silo"] = await run_job(client, f"{name}-1", cfg, n, trainers=1, shards=1)
            bc.add_silo()
            await client.refresh()
            for name, cfg in configs.items():
                n = steps[name]
                for mode in ("sync", "async"):
                    out[name][f"2 trainers, 2 silos, {mode}"] = await run_job(
                        client, f"{name}-2-{mode}", cfg, n, trainers=2, shards=2, mode=mode
                    )
                # The same sync job with consistent checkpoints.
                out[name][CKPT] = await run_job(
                    client, f"{name}-2-ckpt", cfg, n, trainers=2, shards=2, checkpoint_every=CKPT_EVERY
                )
                for comp in COMPRESSIONS[1:]:
                    out[name][comm_label(comp)] = await run_job(
                        client, f"{name}-2-{comp.replace(':', '')}", cfg, n, trainers=2, shards=2, compression=comp
                    )
                # Scaling: two trainers per silo, each silo holding one shard.
                out[name][SCALING[4]] = await run_job(client, f"{name}-4", cfg, n, trainers=4, shards=2)
                out[name]["2 trainers, 2 silos, allreduce"] = await run_job(
                    client, f"{name}-2-ar", cfg, n, trainers=2, mode="allreduce"
                )
            rec_spec, kill_at = recovery_spec(quick)
            # Parameter-server recovery on 3 silos, one killed each time (and replaced after
            # the first); then the all-reduce one on the 2 left, the last thing done here.
            ps_spec = {**rec_spec, "checkpoint_every": default_checkpoint_every()}
            ps_rows: dict[str, Any] = {}
            for victim in ("trainer", "shard"):
                bc.add_silo()
                ps_rows[victim] = await ps_recovery(client, bc, ps_spec, victim, kill_at)
            ours = await redgrain_recovery(client, bc, {**rec_spec, "mode": "allreduce"}, kill_at)
    # One torchrun start for the DDP rows and then its recovery run (the workers run them in turn;
    # after the kill, torchrun's restarted workers skip the rows done and resume from the checkpoint).
    ddp = await asyncio.to_thread(torchrun_ddp_phases, [
        *({"spec": {**cfg, **COMMON, "steps": steps[name], "trainers": 2}} for name, cfg in configs.items()),
        {"spec": rec_spec, "kill_at_step": kill_at, "ckpt_every": rec_spec["checkpoint_every"]},
    ])  # fmt: skip
    for name, row in zip(configs, ddp):
        out[name]["torchrun DDP, 2 workers"] = row
    theirs = ddp[-1]
    out["recovery"] = {"steps": rec_spec["steps"], "checkpoint_every": rec_spec["checkpoint_every"],
                       "redgrain allreduce": ours, "torchrun DDP": theirs,
                       "ps_checkpoint_every": ps_spec["checkpoint_every"], "redgrain PS": ps_rows}  # fmt: skip
    ray = ray_parameter_server([
        {"config": name, "spec": {**cfg, **COMMON, "steps": steps[name], "trainers": n}}
        for name, cfg in configs.items() for n in (1, 2)
    ])  # fmt: skip
    for name in configs:
        if isinstance(ray, str):
            out[name]["ray_note"] = ray
            continue
        out[name]["Ray PS, 1 worker"] = {**ray[name]["1"], "bytes_per_step": 0}
        out[name]["Ray PS, 2 workers, sync"] = {**ray[name]["2"], "bytes_per_step": 0}
    return out


def _quick(cfg: dict[str, Any]) -> dict[str, Any]:
    if "dataset_args" not in cfg:
        return cfg
    return {**cfg, "batch_size": 32, "dataset_args": {**cfg["dataset_args"], "samples": 512, "test_samples": 128}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks training")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, the medium configuration only: checks the benchmark runs")
    parser.add_argument("--cost", action="store_true", help="only the cost of a trainer (benchmarks/training_cost.py)")
    parser.add_argument("--census", action="store_true",
                        help="only the per-step counts of a trainer's step (calls, loop callbacks, thread hand-offs, "
                        "Redis commands): load-independent (benchmarks/step_census.py)")  # fmt: skip
    args = parser.parse_args(argv)
    fix_torch_threads()
    facts = machine_facts()
    print_header("training: plain torch loop vs redgrain trainers and shards", facts, args.quick)
    if args.census:
        from benchmarks import step_census

        census = step_census.main(args.quick)
        write_result("training_census" + ("_quick" if args.quick else ""), {"machine": facts, "quick": args.quick, "census": census})
        return 0
    if args.cost:
        cost = training_cost.main(args.quick)
        write_result("training_cost" + ("_quick" if args.quick else ""), {"machine": facts, "quick": args.quick, "cost": cost})
        return 0
    results = run(measure(args.quick))
    recovery = results.pop("recovery")
    for name, rows in results.items():
        plain = rows["plain"]["samples_per_s"]
        one = rows["1 trainer, 1 silo"]["samples_per_s"]
        none_bytes = rows[SYNC2]["bytes_per_step"]
        print(f"\n## {name}")
        table = []
        ray_note = rows.pop("ray_note", None)
        for label, r in rows.items():
            table.append([
                label, f"{r['samples_per_s']:,.0f}", ratio(r["samples_per_s"], plain),
                ratio(r["samples_per_s"], one) if label.startswith(("2", "4", "torchrun")) else "",
                f"{r['step_ms']:.2f}", f"{r['bytes_per_step'] / 1024:,.1f}",
                ratio(none_bytes, r["bytes_per_step"]) if label.startswith(("2", "4")) else "",
                f"{(r['accuracy'] or 0):.2%}",
            ])  # fmt: skip
        print_table(["run", "samples/s", "vs plain", "vs 1 trainer", "ms/step", "KB/step", "bytes cut", "accuracy"], table)
        if ray_note is not None:
            print(f"Ray parameter-server rows: {ray_note}")
            rows["ray_note"] = ray_note
        else:
            print("redgrain / Ray parameter server, samples/s:"
                  f" 1 trainer {ratio(one, rows['Ray PS, 1 worker']['samples_per_s'])},"
                  f" 2 trainers sync {ratio(rows['2 trainers, 2 silos, sync']['samples_per_s'], rows['Ray PS, 2 workers, sync']['samples_per_s'])}"
                  " (goal on medium: at least 1.00x)")  # fmt: skip
        pair = rows[PAIR]["samples_per_s"]
        print(f"2 independent plain loops reach {ratio(pair, plain)} of one on this machine now; 2 trainers reach"
              f" {ratio(rows['2 trainers, 2 silos, sync']['samples_per_s'], pair)} (sync) and"
              f" {ratio(rows['2 trainers, 2 silos, async']['samples_per_s'], pair)} (async) of that")  # fmt: skip
        overhead = rows["1 trainer, 1 silo"]["step_ms"] - rows["plain"]["step_ms"]
        print(f"per-step overhead of 1 trainer vs the plain loop: {overhead:.2f} ms")
        rows["overhead_ms"] = overhead  # type: ignore[assignment]
        base_ms, every = rows["2 trainers, 2 silos, sync"]["step_ms"], default_checkpoint_every()
        per_ckpt = (rows[CKPT]["step_ms"] - base_ms) * CKPT_EVERY
        cost = per_ckpt / (every * base_ms) if base_ms > 0 else None
        print(f"a consistent checkpoint costs {per_ckpt:.1f} ms of training (sync, every {CKPT_EVERY} steps vs none);"
              f" at the default interval ({every} steps) that is {f'{cost:.1%}' if cost is not None else '-'}"
              " of step time (goal: at most 5%)")  # fmt: skip
        rows["checkpoint_ms"] = per_ckpt  # type: ignore[assignment]
        rows["checkpoint_cost"] = cost  # type: ignore[assignment]
        ar, ddp = rows["2 trainers, 2 silos, allreduce"]["samples_per_s"], rows["torchrun DDP, 2 workers"]["samples_per_s"]
        print(f"allreduce samples/s vs torchrun DDP: {ratio(ar, ddp)} (goal: at least 0.90x)")
        rows["communication"] = print_communication(name, rows)  # type: ignore[assignment]
        rows["scaling"] = print_scaling(name, rows)  # type: ignore[assignment]
    print_recovery(recovery)
    # The cost of a trainer (issue 38's goals), on a cluster of its own: one silo, then a joining one.
    cost = training_cost.main(args.quick)
    write_result(
        "training" + ("_quick" if args.quick else ""),
        {"machine": facts, "quick": args.quick, "results": results, "recovery": recovery, "cost": cost},
    )
    return 0


def print_communication(name: str, rows: dict[str, Any]) -> dict[str, Any]:
    """The communication table; returns its figures by compression kind (for the results file)."""
    compute_ms = rows["plain"]["cpu_ms"]
    none_bytes = rows[SYNC2]["bytes_per_step"]
    print(f"\n## {name}: communication (2 trainers, 2 shards, 2 silos, sync)")
    table, figures = [], {}
    for comp in COMPRESSIONS:
        r = rows[comm_label(comp)]
        exchange_ms = r["step_ms"] - compute_ms
        waited = r.get("waited_ms", 0.0)
        figures[comp] = {"row": comm_label(comp), "bytes_per_step": r["bytes_per_step"], "exchange_ms": exchange_ms,
                         "waited_ms": waited, "samples_per_s": r["samples_per_s"], "accuracy": r["accuracy"]}  # fmt: skip
        table.append([
            comp, f"{r['bytes_per_step'] / 1024:,.1f}", ratio(none_bytes, r["bytes_per_step"]),
            f"{exchange_ms:.2f}", f"{waited:.2f}", f"{r['step_ms']:.2f}", f"{r['samples_per_s']:,.0f}",
            f"{(r['accuracy'] or 0):.2%}",
        ])  # fmt: skip
    print_table(
        ["compression", "KB/step", "bytes cut", "exchange ms/step", "waited ms/step", "ms/step", "samples/s", "accuracy"],
        table,
    )
    print(f"exchange ms/step = ms/step - {compute_ms:.2f} ms, the plain loop's CPU time per step"
          " (forward, backward, optimizer step; the 2 trainers compute theirs in parallel)")  # fmt: skip
    return figures


def print_scaling(name: str, rows: dict[str, Any]) -> dict[str, Any]:
    """The scaling row (sync, 1 / 2 / 4 trainers) against this machine's ceiling."""
    one, ceiling = rows[SCALING[1]]["samples_per_s"], rows[PAIR]["samples_per_s"]
    plain = rows["plain"]["samples_per_s"]
    print(f"\n## {name}: scaling (sync)")
    table, figures = [], {}
    for n, label in SCALING.items():
        rate = rows[label]["samples_per_s"]
        figures[str(n)] = {"row": label, "samples_per_s": rate, "vs_1": rate / one if one else None,
                           "vs_ceiling": rate / ceiling if ceiling else None}  # fmt: skip
        table.append([str(n), label, f"{rate:,.0f}", ratio(rate, one), ratio(rate, ceiling)])
    print_table(["trainers", "run", "samples/s", "vs 1 trainer", "vs ceiling"], table)
    print(f"ceiling: this machine has {os.cpu_count()} cores; '{PAIR}' ({ceiling:,.0f} samples/s, {ratio(ceiling, plain)}"
          " of one plain loop) is the most 2 or 4 trainers can reach here, with no communication at all")  # fmt: skip
    return figures


def recovery_spec(quick: bool) -> tuple[dict[str, Any], int]:
    """The recovery run: small config, 2 trainers, killed a third of the way in."""
    steps, every = (150, 25) if quick else (3000, 200)
    return {**CONFIGS["small"], **COMMON, "steps": steps, "trainers": 2, "checkpoint_every": every}, steps // 3


def print_recovery(rec: dict[str, Any]) -> None:
    print(f"\n## recovery from SIGKILL of one of 2 trainers (small, {rec['steps']} steps, "
          f"checkpoint every {rec['checkpoint_every']})")  # fmt: skip
    ours, theirs = rec["redgrain allreduce"], rec["torchrun DDP"]
    table = [
        ["redgrain allreduce (group re-formed, survivor's state)", _s(ours.get("recovery_s")),
         str(ours.get("lost_steps")), f"{(ours.get('accuracy') or 0):.2%}"],
        ["torchrun DDP (all workers restarted, checkpoint)", _s(theirs.get("recovery_s")),
         str(theirs.get("lost_steps")), f"{(theirs.get('accuracy') or 0):.2%}"],
    ]  # fmt: skip
    print_table(["run", "kill -> next committed step", "steps redone", "accuracy"], table)
    print(f"torchrun recovery / redgrain recovery: {ratio(theirs.get('recovery_s'), ours.get('recovery_s'))}"
          " (goal: above 1.00x; torchrun took 2.3-3.3 s here before)")  # fmt: skip
    if theirs.get("error"):
        print(f"torchrun did not finish the job after the kill: {theirs['error']}")
    ps, every = rec["redgrain PS"], rec["ps_checkpoint_every"]
    print(f"\n## parameter-server mode: SIGKILL of a trainer's or a shard's silo (small, sync, 2 trainers, 2 shards,"
          f" 3 silos, checkpoint every {every})")  # fmt: skip
    print_table(
        ["silo killed", "kill -> next committed step", "detected after", "steps redone", "accuracy"],
        [[f"{victim}'s", _s(r["recovery_s"]), _s(r["detected_s"]), str(r["lost_steps"]), f"{(r['accuracy'] or 0):.2%}"]
         for victim, r in ps.items()],
    )  # fmt: skip
    worst = max(r["recovery_s"] for r in ps.values())
    print(f"slowest parameter-server recovery {worst:.2f} s (goal: at most 3 s), steps redone at most"
          f" {max(r['lost_steps'] for r in ps.values())} (goal: at most one checkpoint interval, {every})")  # fmt: skip


def _s(x: float | None) -> str:
    return f"{x:.2f} s" if x is not None else "-"
