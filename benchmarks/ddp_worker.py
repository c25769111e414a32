"""The torchrun + DDP baseline of the training benchmark: one worker (run by torchrun, not directly).

Same model, optimizer, data and batch schedule as a redgrain job of the same
config (rank r of k trainers takes the r-th share of the global batch). Rank 0 appends one
line per committed step to ``--events`` (``step wall_time restart_count``) and
saves a checkpoint every ``--ckpt-every`` steps; a restarted worker resumes
from it, which is how torchrun recovers from a lost worker. Every worker
writes its pid to ``--pids/rank{r}`` so the benchmark can SIGKILL one.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 benchmarks/ddp_worker.py \\
        --spec '{"model": ...}' --events ev.txt --ckpt ck.pt --pids dir
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="TrainingJob fields as JSON")
    parser.add_argument("--events", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--pids", required=True)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from grains.training.api.job import TrainingJob
    from grains.training.data.batches import Batches
    from grains.training.datasets import load_dataset
    from grains.training.models import build_model
    from grains.training.strategies.ps.shard import make_optimizer

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
    spec = TrainingJob(**json.loads(args.spec))
    model = build_model(spec)
    ddp = DistributedDataParallel(model)
    opt = make_optimizer(list(ddp.parameters()), spec)
    data = Batches(load_dataset(spec, "train"))
    start = 0
    ckpt = Path(args.ckpt)
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = int(saved["step"])
    steps = spec.steps or 0
    events = open(args.events, "a") if rank == 0 else None  # noqa: SIM115 - kept open for the run
    for t in range(start, steps):
        x, y = data.batch(spec.batch_size, trainers, rank, t, spec.seed)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        if events is not None:
            events.write(f"{t} {time.time():.6f} {restart}\n")
            events.flush()
            if args.ckpt_every and (t + 1) % args.ckpt_every == 0:
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
    # Both ranks past their last collective before either tears gloo down: a rank that exits
    # while the other still evaluates resets its pairs, and gloo's thread there aborts the
    # process ("terminate called without an active exception", exit -6; seen under load).
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
