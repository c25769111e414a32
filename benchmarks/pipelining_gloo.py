"""Experiment: torch.distributed.pipelining on gloo, CPU, 2 processes, against redgrain's stage grains.

``python -m benchmarks.pipelining_gloo [--quick]``. Not one of the ``bench_*``
rows: it answers the question issue 18 asks before relying on torch's
pipelining engine (alpha; its multi-process tests are NCCL-only): does it
run on gloo with the installed torch, does it compute what one process
computes, and how fast is it next to the grain pipeline on the same model?

1. **Splitter.** ``pipeline(module, mb_args, split_spec={name:
   SplitPoint.BEGINNING})`` on a residual network (a loop over blocks, not an
   ``nn.Sequential``): does it cut, and which parameter names do the stages keep?
2. **Runtime.** Two processes (``torch.multiprocessing`` spawn), a gloo
   process group, ``PipelineStage`` holding half of the bench's
   ``nn.Sequential`` MLP (1024 wide, 6 linear layers) each, ``ScheduleGPipe``
   and ``Schedule1F1B`` with 8 micro-batches, SGD with momentum; per-step
   wall time (median after 2 warm-up steps) and, after the steps, the weights
   against a plain single-process loop on the same batches.
3. **The grain pipeline** (``mode = "pipeline"``, 2 stage grains on 2 silo
   processes), same model, batch, micro-batches and optimizer: step time as
   ``bench_pipeline`` reads it.

Every process at one torch thread, as in the other benchmarks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

WIDTH = 1024
HIDDEN = [1024, 1024, 1024, 1024]
CLASSES = 10
LR, MOMENTUM = 0.01, 0.9


def build() -> torch.nn.Module:
    from grains.training.models import mlp

    torch.manual_seed(0)
    return mlp(WIDTH, HIDDEN, WIDTH)  # as bench_pipeline: 1024 outputs, labels in 0..9


def batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, WIDTH, generator=g), torch.randint(0, CLASSES, (batch,), generator=g)) for _ in range(steps)]


def plain_loop(steps: int, batch: int) -> tuple[dict[str, torch.Tensor], float]:
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    times = []
    for x, y in batches(steps, batch):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, statistics.median(times[2:])


def _worker(rank: int, store_path: str, out_dir: str, schedule_name: str, steps: int, batch: int, micro: int) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        model = build()
        children = list(model.named_children())
        half = len(children) // 2
        mine = torch.nn.Sequential()
        for name, child in children[:half] if rank == 0 else children[half:]:
            mine.add_module(name, child)
        stage = PipelineStage(mine, stage_index=rank, num_stages=2, device=torch.device("cpu"))
        cls = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
        schedule = cls(stage, n_microbatches=micro, loss_fn=lambda out, y: F.cross_entropy(out, y))
        opt = torch.optim.SGD(mine.parameters(), lr=LR, momentum=MOMENTUM)
        times = []
        for x, y in batches(steps, batch):
            t0 = time.perf_counter()
            opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=[])
            opt.step()
            times.append(time.perf_counter() - t0)
        torch.save({"times": times, "state": {k: v.detach() for k, v in mine.state_dict().items()}},
                   os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
    except Exception:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def torch_pipelining(schedule: str, steps: int, batch: int, micro: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        try:
            mp.spawn(_worker, args=(store, tmp, schedule, steps, batch, micro), nprocs=2, join=True)
        except Exception as exc:  # noqa: BLE001 - the experiment reports what failed
            errs = [Path(tmp, f).read_text() for f in sorted(os.listdir(tmp)) if f.endswith(".err")]
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": errs[-1][-3000:] if errs else ""}
        parts = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in range(2)]
    step_s = statistics.median(max(a, b) for a, b in zip(parts[0]["times"][2:], parts[1]["times"][2:], strict=True))
    state = {**parts[0]["state"], **parts[1]["state"]}
    return {"ok": True, "step_ms": 1000 * step_s, "state": state}


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


class ResNet(torch.nn.Module):
    """The residual net of tests/grains/training/test_pipeline_split.py (a loop over blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(64, 32)
        self.blocks = torch.nn.ModuleList(_Block(32) for _ in range(3))
        self.gain = torch.nn.Parameter(torch.ones(32))
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h * self.gain)


def splitter() -> dict[str, Any]:
    from torch.distributed.pipelining import SplitPoint, pipeline

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = ResNet()
            pipe = pipeline(model, mb_args=(torch.randn(8, 64),), split_spec={"blocks.1": SplitPoint.BEGINNING})
            names = {n: [p for p, _ in m.named_parameters()] for n, m in pipe.split_gm.named_children()}
            out: dict[str, Any] = {"ok": True, "stages": pipe.num_stages, "names": names}
        except Exception as exc:  # noqa: BLE001
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out["warnings"] = sorted({str(w.message)[:160] for w in caught})
    return out


async def grain_pipeline(schedule: str, steps: int, batch: int, micro: int) -> float:
    from benchmarks.bench_pipeline import run_job
    from benchmarks.common import BenchCluster
    from silo.client import ClusterClient

    with BenchCluster(2, grains="grains.training") as bc:
        async with await ClusterClient.connect(bc.redis_url, cluster=bc.cluster) as client:
            await client.refresh()
            r = await run_job(client, f"grain-{schedule}", steps, mode="pipeline", trainers=1, stages=2,
                              microbatches=micro, schedule=schedule, batch_size=batch)  # fmt: skip
    return float(r["step_ms"])


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import (
        fix_torch_threads,
        machine_facts,
        print_header,
        print_table,
        write_result,
    )

    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipelining_gloo")
    parser.add_argument("--quick", action="store_true", help="a few steps: checks the experiment runs")
    args = parser.parse_args(argv)
    fix_torch_threads()
    facts = machine_facts()
    print_header("torch.distributed.pipelining on gloo vs redgrain's stage grains", facts, args.quick)
    steps, batch, micro = (6, 64, 8) if args.quick else (30, 256, 8)
    split = splitter()
    print(f"\n## pipeline() splitter on a residual net at 'blocks.1': {'cuts' if split['ok'] else 'fails'}")
    print(split.get("names") or split.get("error"))
    for w in split["warnings"]:
        print("  warning:", w)
    want, plain_s = plain_loop(steps, batch)
    rows, results = [], {"splitter": {k: v for k, v in split.items()}, "plain_ms": 1000 * plain_s}
    for schedule in ("gpipe", "1f1b"):
        ours_ms = asyncio.run(grain_pipeline(schedule, max(steps, 10), batch, micro))
        theirs = torch_pipelining(schedule, steps, batch, micro)
        if theirs["ok"]:
            diff = max(float((theirs["state"][k] - v).abs().max()) for k, v in want.items())
            rows.append([schedule, f"{theirs['step_ms']:.1f}", f"{ours_ms:.1f}", f"{ours_ms / theirs['step_ms']:.2f}x",
                         f"{diff:.1e}"])  # fmt: skip
            results[schedule] = {"torch_ms": theirs["step_ms"], "grain_ms": ours_ms, "max_weight_diff": diff}
        else:
            print(f"\n{schedule}: torch.distributed.pipelining failed on gloo: {theirs['error']}\n{theirs['traceback']}")
            rows.append([schedule, "failed", f"{ours_ms:.1f}", "-", "-"])
            results[schedule] = {"error": theirs["error"], "grain_ms": ours_ms}
    print(f"\n## 2 stages, batch {batch}, {micro} micro-batches, SGD momentum; plain loop {1000 * plain_s:.1f} ms/step")
    print_table(["schedule", "torch pipelining ms/step", "grain pipeline ms/step", "grain time / torch time",
                 "torch's weights vs plain loop (max abs diff)"], rows)  # fmt: skip
    write_result("pipelining_gloo" + ("_quick" if args.quick else ""), {"machine": facts, "quick": args.quick, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
