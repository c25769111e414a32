"""The torchrun + DDP baseline of the training benchmark: one worker (run by torchrun, not directly).

Same model, optimizer, data and batch schedule as a redgrain job of the same
config (rank r of k trainers takes the r-th share of the global batch). ``--phases`` lists the
jobs the workers run in turn, in one process group (the benchmark's rows and
its recovery run share one torchrun start); each phase names its spec, its
events file, its checkpoint path and interval. Rank 0 appends one line per
committed step to the phase's events file (``step wall_time restart_count``,
then ``done wall_time accuracy``) and saves a checkpoint every ``ckpt_every``
steps; a restarted worker skips the phases whose events say done and resumes
the current one from its checkpoint, which is how torchrun recovers from a
lost worker. Every worker writes its pid to ``--pids/rank{r}`` so the
benchmark can SIGKILL one.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 benchmarks/ddp_worker.py \\
        --phases '[{"spec": {"model": ...}, "events": "ev.txt", "ckpt": "ck.pt", "ckpt_every": 0}]' --pids dir
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phases", required=True, help="JSON list of {spec, events, ckpt, ckpt_every}")
    parser.add_argument("--pids", required=True)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from grains.training.api.job import TrainingJob

    torch.set_num_threads(1)
    rank, trainers = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    Path(args.pids).mkdir(parents=True, exist_ok=True)
    (Path(args.pids) / f"rank{rank}").write_text(str(os.getpid()))
    # torchrun's agent hosts the store; its restarted workers would read the dead attempt's
    # gloo addresses from it (seen with torch 2.13, --standalone), so each attempt gets a prefix.
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), trainers, is_master=False)
    store = dist.PrefixStore(f"redgrain_attempt_{restart}", agent_store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=trainers)
    for phase in json.loads(args.phases):
        events = Path(phase["events"])
        if events.exists() and any(line.startswith("done ") for line in events.read_text().splitlines()):
            continue  # finished before a restart (every rank passed its closing barrier)
        run_phase(TrainingJob(**phase["spec"]), rank, trainers, restart, events, Path(phase["ckpt"]), int(phase.get("ckpt_every", 0)))
    dist.destroy_process_group()
    return 0


def run_phase(spec: Any, rank: int, trainers: int, restart: int, events_path: Path, ckpt: Path, ckpt_every: int) -> None:
    """One job in the workers' process group, resumed from ``ckpt`` when it exists."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from grains.training.data.batches import Batches
    from grains.training.datasets import load_dataset
    from grains.training.models import build_model
    from grains.training.strategies.ps.shard import make_optimizer

    model = build_model(spec)
    ddp = DistributedDataParallel(model)
    opt = make_optimizer(list(ddp.parameters()), spec)
    data = Batches(load_dataset(spec, "train"))
    start = 0
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = int(saved["step"])
    steps = spec.steps or 0
    events = open(events_path, "a") if rank == 0 else None  # noqa: SIM115 - kept open for the run
    for t in range(start, steps):
        x, y = data.batch(spec.batch_size, trainers, rank, t, spec.seed)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        if events is not None:
            events.write(f"{t} {time.time():.6f} {restart}\n")
            events.flush()
            if ckpt_every and (t + 1) % ckpt_every == 0:
                tmp = ckpt.with_suffix(".tmp")
                torch.save(
                    {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": t + 1}, tmp
                )
                os.replace(tmp, ckpt)
    if events is not None:
        tx, ty = Batches(load_dataset(spec, "test")).all()
        with torch.no_grad():
            acc = float((model(tx).argmax(1) == ty).float().mean())
        events.write(f"done {time.time():.6f} {acc}\n")
        events.close()
    # Both ranks past their last collective before either goes on (to the next phase, or to tear
    # gloo down: a rank that exits while the other still evaluates resets its pairs, and gloo's
    # thread there aborts the process ("terminate called without an active exception", exit -6;
    # seen under load)); and rank 0's "done" is written before any rank starts the next phase.
    dist.barrier()


if __name__ == "__main__":
    sys.exit(main())
