"""ParamShardGrain: a slice of the parameters, its optimizer state, and the update rule.

One call per trainer per step, :meth:`ParamShardGrain.exchange`, pushes that
trainer's gradients and returns the parameters it should use next, waiting
as the mode says:

- ``sync``: gradients of step t are summed until every trainer has pushed, then
  averaged and applied once (torch's own optimizer, fp32 master weights);
  the reply waits for version t+1. Same math as one process on the global
  batch.
- ``async``: every push is applied as it comes; the reply never waits, but
  for the first step's: it waits until every trainer's first push is applied
  (so trainers start together, whenever each became ready).
- ``ssp``: like async, but the reply waits while the caller is more than
  ``staleness`` steps ahead of the slowest trainer.

In async and ssp, an Adam-family push is first carried from the weights its
trainer computed on to the current ones (delay compensation,
:func:`~grains.training.strategies.ps.shard_core.compensated`); the shard
keeps the last few versions it sent each trainer for that.

A push carries ``(rank, step)``; one the shard has already taken is ignored,
so a retried push is applied once. The shard is ``@reentrant``: a waiting
exchange never blocks the pushes that will release it. Every call carries the
coordinator's generation; after a rollback, calls of an older generation are
refused.

The optimizer is the job's (:mod:`grains.training.loop.optim`: any torch
optimizer, parameter groups, a learning-rate schedule stepped once per global
step). A shard also holds its part of the frozen parameters (sent once, on a
trainer's first pull) and of the persistent buffers: trainers push their
buffers with their gradients; in sync mode the shard sets each floating
buffer to the mean of the trainers' values of the step (integer ones, like
``num_batches_tracked``, to any trainer's: they count alike), in async and ssp
to the value of the latest push. With ``clip_grad_norm`` in sync mode the
shards of a job exchange the squared norms of their parts of the averaged
gradient (:meth:`ParamShardGrain.norm_part`), so all clip by one global norm.
A step that any trainer flags as skipped (a non-finite loss with
``on_nonfinite = "skip"``, an fp16 overflow) updates nothing on any shard.

Checkpoints: at each multiple ``c`` of ``checkpoint_every`` (and at the job's
last step) the shard copies
its parameters and optimizer state exactly when every push of steps < c and
none of steps >= c is applied (in async/ssp a push of step >= c waits for
that moment), and saves the copy in the background; the coordinator commits
``c`` once every shard has saved it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from grains.base import Grain
from grains.placement import hash_placement, immovable, keep_alive, reentrant
from grains.training.api.messages import (
    ExchangeReply,
    ShardConfig,
    ShardStatus,
    StaleGenerationError,
)
from grains.training.loop.compression import Payload, payload_nbytes
from grains.training.loop.optim import build_optimizer, clip_coefficient
from grains.training.models import build_model
from grains.training.state import checkpoint
from grains.training.state.checkpoint import SnapshotState, TrainingSnapshot
from grains.training.state.model_tensors import persistent_buffers
from grains.training.strategies.ps.inline import InlineWhenCheap, whole
from grains.training.strategies.ps.shard_core import ShardCore

log = logging.getLogger("redgrain.training.shard")


ADAPTIVE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
)  # fmt: skip
"""Optimizers whose step divides by a running gradient scale (subclasses included): their
step's size does not follow the gradient's noise, so they take the square-root rule below."""


_SENT_KEPT = 3
"""Versions kept per trainer for delay compensation: a pipelined async trainer's push is computed
on the reply before its last (a reply may carry none when the version did not change)."""

UPDATE_BUDGET_S = 0.004
"""The inline budget of a shard's update (inline.py), above a step's: an update of many small
tensors (AdamW over the tiny BERT's 41: ~1.4 ms) is torch's dispatcher and Python, holding the
GIL, so on the executor it holds the loop about as long and costs two thread hops besides;
an update whose kernels take longer (a large model's, which release the GIL) still goes to
the executor."""


def push_lr_scale(mode: str, trainers: int, opt: torch.optim.Optimizer | None) -> float:
    """The factor on each param group's lr for one push applied alone (async, ssp).

    A push is one trainer's gradient, of 1/k of the global batch (k trainers),
    applied as a whole optimizer step: k steps per global step where sync takes
    one. Each optimizer gets its own batch-size scaling rule for that 1/k batch:

    - SGD, momentum-SGD (and any optimizer not in ``ADAPTIVE``): ``1/k`` in async
      (the linear rule; Zhang, Gupta, Lian and Liu, "Staleness-aware Async-SGD",
      IJCAI 2016: the synchronous rate over the mean staleness, about k). Without
      it momentum-SGD ended between 38% and 93% on the digits config where sync
      reaches 97%. ssp keeps the job's rate: its bound holds the mean staleness
      under one update (measured 0.8), and 97.3% vs 97.1% measured.
    - Adam, AdamW and the rest of ``ADAPTIVE``: ``1/sqrt(k)`` in async and ssp
      (the square-root rule of Malladi, Lyu, Panigrahi and Arora, "On the SDEs and
      scaling rules for adaptive gradient algorithms", NeurIPS 2022). Adam's step
      is about lr whatever the gradient's size, so 1/k made the k pushes of a
      global step move the weights as far as one sync step while each is noisier:
      on the HF-style fine-tune (tiny BERT, AdamW, 160 steps, 2 trainers, seeds
      1-4) async ended 6.0 F1 points behind sync at 1/k, 3.3 behind with no
      scaling, 4.1 behind at 1/(1 + the push's staleness), 1.7 behind at
      1/sqrt(k); ssp within 0.5 points either way (docs/training.md, "Modes").

    The lr, not the gradient, is scaled: a scaled gradient changes nothing for
    Adam, and decoupled weight decay follows the lr. One trainer: 1.
    """
    k = max(1, trainers)
    if isinstance(opt, ADAPTIVE):
        return 1.0 / math.sqrt(k)
    return 1.0 / k if mode == "async" else 1.0


def make_optimizer(params: list[nn.Parameter], spec: Any) -> torch.optim.Optimizer:
    """The job's optimizer over a whole model's parameters (plain loops and benchmarks; no groups by name)."""
    opt = build_optimizer([(str(i), p) for i, p in enumerate(params)], spec.model_copy(update={"param_groups": []}))
    assert opt is not None
    return opt


@dataclass(frozen=True, slots=True)
class ShardStatistics:
    version: int
    """Updates applied since the shard was configured."""
    pushes: int
    """Gradient pushes taken."""
    duplicates: int
    """Pushes ignored as already taken (retries)."""
    bytes_in: int
    """Tensor bytes received in pushes."""
    bytes_out: int
    """Tensor bytes sent in pulls."""


@keep_alive
@immovable
@reentrant
@hash_placement
class ParamShardGrain(Grain):
    State = SnapshotState

    def __init__(self) -> None:
        self._cfg: ShardConfig | None = None
        self._core: ShardCore | None = None
        self._generation = -1
        self._mode = "sync"
        self._staleness = 0
        self._every = 0
        self._next: list[int] = []  # per rank: next step expected (taken pushes)
        self._applied: list[int] = []  # per rank: next step whose push is not yet applied
        self._acc_step = -1
        self._acc_ranks: set[int] = set()
        self._next_ckpt = 0
        self._saved: list[int] = []
        self._changed = asyncio.Condition()
        self._lock = asyncio.Lock()
        self._pushes = self._duplicates = self._bytes_in = self._bytes_out = 0
        self._max_staleness = self._max_gap = 0
        self._end = 0
        self._norms: dict[int, dict[int, float]] = {}  # sync clipping: step -> shard index -> squared norm
        self._started: set[int] = set()  # async/ssp: ranks whose first push of this configuration came
        self._sent: list[deque[tuple[int, dict[str, torch.Tensor]]]] = []  # per rank: versions last sent (compensation)
        self._updates = InlineWhenCheap(self.run_in_thread, UPDATE_BUDGET_S)  # inline while cheap (inline.py)

    # --- configuration ------------------------------------------------------
    async def configure(self, cfg: ShardConfig) -> ShardStatus:
        """Start (or restart) this shard for a generation: seeded weights or a checkpoint."""
        async with self._changed:
            self._generation = cfg.generation  # older callers wake up and leave
            self._changed.notify_all()
        snapshot = None
        if cfg.restore_step is not None:
            snapshot = await self._restore(cfg)
        async with self._lock:
            core = await self.run_in_thread(ShardCore, cfg, self.device, snapshot)
            start = cfg.restore_step or 0
            self._cfg, self._core = cfg, core
            self._updates = InlineWhenCheap(self.run_in_thread, UPDATE_BUDGET_S)  # a new core: measured afresh
            self._mode, self._staleness, self._every = cfg.spec.mode, cfg.spec.staleness, cfg.spec.checkpoint_every
            self._next = [start] * cfg.trainers
            self._applied = [start] * cfg.trainers
            self._acc_step, self._acc_ranks = -1, set()
            self._end = cfg.end_step
            self._next_ckpt = self._checkpoint_after(start)
            self._saved = [cfg.restore_step] if cfg.restore_step is not None else []
            self._norms = {}
            self._started = set()
            self._sent = [deque(maxlen=_SENT_KEPT) for _ in range(cfg.trainers)]
        async with self._changed:
            self._changed.notify_all()
        return await self.status()

    async def _restore(self, cfg: ShardConfig) -> TrainingSnapshot:
        assert cfg.restore_step is not None
        if cfg.kinds is not None:
            held = set(cfg.kinds.frozen) | set(cfg.kinds.buffers)
            names = [n for n in cfg.names if n not in held]
            return await checkpoint.load(self, cfg.job, cfg.run, cfg.restore_step, names, [*cfg.kinds.frozen, *cfg.kinds.buffers])
        model = await self.run_in_thread(build_model, cfg.spec)
        own = set(cfg.names)
        names = [n for n, p in model.named_parameters() if n in own and p.requires_grad]
        extra = [n for n, p in model.named_parameters() if n in own and not p.requires_grad]
        extra += [n for n, _ in persistent_buffers(model) if n in own]
        return await checkpoint.load(self, cfg.job, cfg.run, cfg.restore_step, names, extra)

    def _checkpoint_after(self, step: int) -> int:
        """The next step > ``step`` to checkpoint (:func:`checkpoint.next_checkpoint`; 0: none)."""
        assert self._cfg is not None
        return checkpoint.next_checkpoint(self._cfg.spec, step, self._end)

    async def stop(self, generation: int) -> None:
        """Refuse further exchanges of older generations (the job ended or was cancelled)."""
        async with self._changed:
            self._generation = max(self._generation, generation)
            self._changed.notify_all()

    # --- the step path ------------------------------------------------------
    async def exchange(
        self,
        generation: int,
        rank: int,
        step: int,
        grads: dict[str, Payload] | None,
        base_version: int,
        have_version: int,
        buffers: dict[str, torch.Tensor] | None = None,
        skip: bool = False,
    ) -> ExchangeReply:
        """Push ``grads`` (and ``buffers``) of ``(rank, step)`` (None: pull only), then return what
        the mode allows; ``skip``: the step's update is skipped (on every shard)."""
        self._check(generation)
        staleness = 0
        if grads is not None:
            # Whole: a push the shard has taken is applied whole even if the caller gives up
            # (a restarted trainer's retry is then a duplicate, never half a step); an inline
            # update never suspends, and then runs without the shield's task (inline.py).
            staleness = await whole(self._push(generation, rank, step, grads, base_version, buffers, skip))
            if self._mode != "sync" and rank not in self._started:
                await self._start_together(generation, rank, step)
        gap = await self._wait_turn(generation, rank, step + (grads is not None))
        core = self._core
        assert core is not None
        version, published = core.current
        params = None
        if version != have_version:
            if have_version >= 0 or not core.frozen:
                params, nbytes = published, core.published_nbytes
            else:
                params = {**published, **core.frozen_payload()}
                nbytes = sum(t.nbytes for t in params.values())
            if core.compensation:
                self._sent[rank].append((version, published))
            self._bytes_out += nbytes
        return ExchangeReply(version=version, params=params, staleness=staleness, gap=gap)

    def _check(self, generation: int) -> None:
        if generation != self._generation or self._core is None:
            raise StaleGenerationError(
                f"{self.key} is at generation {self._generation}, the call is of generation {generation}"
            )

    async def _push(
        self, generation: int, rank: int, step: int, grads: dict[str, Payload], base: int,
        buffers: dict[str, torch.Tensor] | None, skip: bool,
    ) -> int:  # fmt: skip
        if step < self._next[rank]:
            self._duplicates += 1
            return 0
        if self._mode == "sync" and step != self._next[rank]:
            raise StaleGenerationError(f"{self.key}: trainer {rank} pushed step {step}, expected {self._next[rank]}")
        self._next[rank] = step + 1
        self._pushes += 1
        self._bytes_in += sum(p.nbytes if type(p) is torch.Tensor else payload_nbytes(p) for p in grads.values())
        core = self._core
        assert core is not None
        if self._mode == "sync":
            async with self._lock:
                self._check(generation)
                first = self._acc_step != step
                if first:
                    self._acc_step, self._acc_ranks = step, set()
                last = len(self._acc_ranks | {rank}) == len(self._next)
                scale = 1.0 / len(self._next)
                if last and core.clip is not None:
                    await self._updates.run(core.accumulate, grads, buffers, skip, first)
                    mean, sq = await self._updates.run(core.pending_norm_sq, scale)
                    total = await self._global_norm_sq(generation, step, sq)
                    coef = clip_coefficient(math.sqrt(total), core.clip)
                    await self._updates.run(core.finish_step, mean, scale, step + 1, coef)
                else:
                    # One thread hop: the push that completes the step also applies it.
                    await self._updates.run(core.push_sync, grads, buffers, skip, first, scale if last else None, step)
                self._acc_ranks.add(rank)
                self._applied[rank] = step + 1
                if last:
                    await self._maybe_snapshot(core)
            staleness = 0
        else:
            await self._wait_for_checkpoint(generation, step)
            async with self._lock:
                self._check(generation)
                staleness = core.version - base if base >= 0 else 0
                self._applied[rank] = step + 1
                pulled = self._pulled(rank, base) if base != core.version else None
                await self._updates.run(core.apply_push, grads, buffers, skip, self._done_step(), self._lr_scale(), pulled)
                await self._maybe_snapshot(core)
        self._max_staleness = max(self._max_staleness, staleness)
        async with self._changed:
            self._changed.notify_all()
        return staleness

    def _pulled(self, rank: int, version: int) -> dict[str, torch.Tensor] | None:
        """The parameters of ``version`` as sent to ``rank`` (DC-ASGD's per-trainer backup: a
        pipelined async trainer computes on the reply before its last, so the last few are kept)."""
        if rank >= len(self._sent):
            return None
        return next((params for v, params in self._sent[rank] if v == version), None)

    async def _start_together(self, generation: int, rank: int, step: int) -> None:
        """async/ssp: the reply to a trainer's first push waits until every trainer's push of that
        step is applied, so they start together. Measured on a fresh cluster (the silos' first
        job imports the model's libraries): one trainer computed its first step 1-2.7 s after the
        other, which ran the 16 steps to the first checkpoint alone, at the warmup's lr of step
        0 (its gradients reached only Adam's moments), waited there, and then pushed 17 updates
        stale. Waiting at the first pull instead left the first step's own warm-up (1.5 s on one
        silo) to skew them. A trainer restarted later finds the others past its step."""
        self._started.add(rank)
        async with self._changed:
            while self._done_step() <= step:
                self._check(generation)
                await self._changed.wait()

    def _lr_scale(self) -> float:
        """The factor on every param group's lr for one async/ssp push (:func:`push_lr_scale`)."""
        core = self._core
        return push_lr_scale(self._mode, len(self._next), core.opt if core is not None else None)

    async def _global_norm_sq(self, generation: int, step: int, sq: float) -> float:
        """Sync clipping: the sum of every shard's squared norm of step ``step``'s mean gradient."""
        cfg = self._cfg
        assert cfg is not None
        if len(cfg.shard_keys) == 1:
            return sq
        peers = [self.get_grain(ParamShardGrain, k) for i, k in enumerate(cfg.shard_keys) if i != cfg.index]
        timeout = cfg.spec.step_timeout_s
        await asyncio.gather(*(p.with_timeout(timeout).norm_part(generation, step, cfg.index, sq) for p in peers))
        await self.norm_part(generation, step, cfg.index, sq)
        async with self._changed:
            while len(self._norms.get(step, {})) < len(cfg.shard_keys):
                self._check(generation)
                await self._changed.wait()
        parts = self._norms.pop(step)
        for old in [s for s in self._norms if s < step]:
            del self._norms[old]
        return sum(parts.values())

    async def norm_part(self, generation: int, step: int, index: int, sq: float) -> None:
        """A peer shard's squared norm of its part of step ``step``'s mean gradient (sync clipping)."""
        self._check(generation)
        async with self._changed:
            self._norms.setdefault(step, {})[index] = sq
            self._changed.notify_all()

    def _done_step(self) -> int:
        """Every push of a step below this is applied."""
        return min(self._applied)

    async def _maybe_snapshot(self, core: ShardCore) -> None:
        # Called under self._lock, right after an apply: nothing else can change the tensors.
        if not self._next_ckpt or self._done_step() < self._next_ckpt:
            return
        if self._mode == "sync" and self._acc_step >= self._next_ckpt and len(self._acc_ranks) < len(self._next):
            return  # a later step is half accumulated; cannot happen in sync, kept as a guard
        step = self._next_ckpt
        snap = await self.run_in_thread(core.snapshot, step)
        self._next_ckpt = self._checkpoint_after(step)
        generation = self._generation
        self.start_task(self._save(snap, generation), name=f"{self.key} checkpoint {step}")

    async def _save(self, snap: TrainingSnapshot, generation: int) -> None:
        cfg = self._cfg
        assert cfg is not None
        try:
            await checkpoint.save(self, cfg.job, cfg.run, snap, cfg.shard_keys, checkpoint.retained(cfg.spec), generation)
        except Exception:
            log.exception("%s: saving checkpoint %d failed", self.key, snap.step)
            return
        if generation == self._generation:
            self._saved = [*self._saved, snap.step][-10:]

    async def _wait_for_checkpoint(self, generation: int, step: int) -> None:
        """async/ssp: a push of step >= the next checkpoint waits until that checkpoint is taken."""
        if not self._next_ckpt:
            return
        async with self._changed:
            while self._next_ckpt and step >= self._next_ckpt:
                self._check(generation)
                await self._changed.wait()

    async def _wait_turn(self, generation: int, rank: int, next_step: int) -> int:
        """Block the reply as the mode says; returns the ssp gap at release."""
        if self._mode == "async":
            return 0
        async with self._changed:
            if self._mode == "sync":
                while self._core is not None and self._core.version < next_step:
                    self._check(generation)
                    await self._changed.wait()
                self._check(generation)
                return 0
            while next_step - self._done_step() > self._staleness:
                self._check(generation)
                await self._changed.wait()
            self._check(generation)
        gap = max(0, next_step - self._done_step())
        self._max_gap = max(self._max_gap, gap)
        return gap

    # --- inspection ---------------------------------------------------------
    async def status(self) -> ShardStatus:
        core = self._core
        return ShardStatus(
            activation_id=self.activation_id,
            generation=self._generation,
            version=core.version if core else 0,
            next_steps=list(self._next),
            saved_steps=list(self._saved),
            pushes=self._pushes,
            duplicates=self._duplicates,
            max_staleness=self._max_staleness,
            max_gap=self._max_gap,
            skipped=core.skipped if core else 0,
            silo=str(self.silo),
        )

    async def parameters(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights, trainable and frozen (copies)."""
        core = self._core
        if core is None:
            return {}
        async with self._lock:
            out = {n: p.detach().to("cpu", copy=True) for n, p in core.params.items()}
            out.update({n: t.detach().to("cpu", copy=True) for n, t in core.frozen.items()})
            return out

    async def tensors(self) -> dict[str, torch.Tensor]:
        """Parameters (fp32) and buffers, copies: this shard's part of the model's state_dict."""
        core = self._core
        if core is None:
            return {}
        async with self._lock:
            return await self.run_in_thread(core.tensors)

    async def release(self) -> None:
        """The job is over and its final checkpoint committed: free the tensors, deactivate."""
        async with self._changed:
            self._generation += 1
            self._changed.notify_all()
        async with self._lock:
            self._core = None
        self.deactivate_on_idle()

    async def export_state(self) -> TrainingSnapshot | None:
        """Parameters and optimizer state as a checkpoint would hold them now."""
        core = self._core
        if core is None:
            return None
        async with self._lock:
            return await self.run_in_thread(core.snapshot, self._done_step())

    def statistics(self) -> ShardStatistics:
        return ShardStatistics(
            version=self._core.version if self._core else 0,
            pushes=self._pushes,
            duplicates=self._duplicates,
            bytes_in=self._bytes_in,
            bytes_out=self._bytes_out,
        )
