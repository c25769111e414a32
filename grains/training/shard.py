"""ParamShardGrain: a slice of the parameters, its optimizer state, and the update rule.

One call per trainer per step, :meth:`ParamShardGrain.exchange`, pushes that
trainer's gradients and returns the parameters it should use next, waiting
as the mode says:

- ``sync``: gradients of step t are summed until every slot has pushed, then
  averaged and applied once (torch's own optimizer, fp32 master weights);
  the reply waits for version t+1. Same math as one process on the global
  batch.
- ``async``: every push is applied as it comes; the reply never waits.
- ``ssp``: like async, but the reply waits while the caller is more than
  ``staleness`` steps ahead of the slowest slot.

A push carries ``(slot, step)``; one the shard has already taken is ignored,
so a retried push is applied once. The shard is ``@reentrant``: a waiting
exchange never blocks the pushes that will release it. Every call carries the
coordinator's generation; after a rollback, calls of an older generation are
refused.

Checkpoints: at each multiple ``c`` of ``checkpoint_every`` the shard copies
its parameters and optimizer state exactly when every push of steps < c and
none of steps >= c is applied (in async/ssp a push of step >= c waits for
that moment), and saves the copy in the background; the coordinator commits
``c`` once every shard has saved it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from grains.base import Grain
from grains.placement import hash_placement, immovable, keep_alive, reentrant
from grains.training import checkpointing
from grains.training.checkpointing import ShardSnapshot, SnapshotState
from grains.training.compression import Payload, decompress_into, parse_compression, payload_nbytes
from grains.training.messages import ExchangeReply, ShardConfig, ShardStatus
from grains.training.models import build_model

log = logging.getLogger("redgrain.training.shard")


class StaleGenerationError(Exception):
    """The job moved on (rollback or restart); the caller belongs to an older generation."""


def make_optimizer(params: list[nn.Parameter], spec: Any) -> torch.optim.Optimizer:
    if spec.optimizer == "adam":
        return torch.optim.Adam(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)
    momentum = spec.momentum if spec.optimizer == "momentum" else 0.0
    return torch.optim.SGD(params, lr=spec.lr, momentum=momentum, weight_decay=spec.weight_decay)


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


class _Core:
    """The tensors of one configuration; its methods run on the silo's executor."""

    def __init__(self, cfg: ShardConfig, device: str, snapshot: ShardSnapshot | None) -> None:
        spec = cfg.spec
        model = build_model(spec)
        named = dict(model.named_parameters())
        self.names = list(cfg.names)
        self.params = {n: nn.Parameter(named[n].detach().to(device, torch.float32).clone()) for n in self.names}
        self.opt = make_optimizer(list(self.params.values()), spec)
        self.pull_dtype = parse_compression(spec.compression).pull_dtype
        self.acc: dict[str, torch.Tensor] = {}
        self._held: dict[str, Payload] | None = None  # the step's first push, not yet summed
        version = 0
        if snapshot is not None:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(snapshot.params[n])
            self.opt.load_state_dict(snapshot.optimizer)
            version = snapshot.version
        self.current: tuple[int, dict[str, torch.Tensor]] = (version, self.publish())
        """The version and its parameters in the pull dtype, replaced in one assignment: updates
        run on the executor while the event loop answers pulls, which must never pair a new
        version with the old tensors (a sync trainer would then compute on stale weights)."""

    @property
    def version(self) -> int:
        return self.current[0]

    def publish(self) -> dict[str, torch.Tensor]:
        """A fresh copy of the parameters in the pull dtype (callers may hold it by reference)."""
        return {n: p.detach().to(self.pull_dtype, copy=True) for n, p in self.params.items()}

    def accumulate(self, grads: dict[str, Payload], first: bool) -> None:
        # The first push is only held (in sync mode its sender waits for the step, so
        # nobody writes to it meanwhile); the second is summed with it in one pass.
        if first:
            self._held = grads
            return
        held, self._held = self._held, None
        for n in self.names:
            if n not in self.acc:
                self.acc[n] = torch.zeros_like(self.params[n])
            acc = self.acc[n]
            if held is None:
                decompress_into(acc, grads[n], add=True)
                continue
            a, b = held[n], grads[n]
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype == acc.dtype:
                torch.add(a, b, out=acc)
            else:
                decompress_into(acc, a, add=False)
                decompress_into(acc, b, add=True)

    def push_sync(self, grads: dict[str, Payload], first: bool, scale: float | None) -> None:
        """Add one slot's gradients to the step's sum; with ``scale``, apply the averaged sum."""
        if first and scale == 1.0:  # a single slot: nothing to sum
            self.apply(grads, 1.0)
            return
        self.accumulate(grads, first)
        if scale is not None:
            self.apply(None, scale)

    def apply(self, grads: dict[str, Payload] | None, scale: float) -> None:
        """One optimizer step with ``grads`` (or the accumulated sum times ``scale``)."""
        for n, p in self.params.items():
            if grads is None:
                g = self.acc[n]
                if scale != 1.0:
                    g.mul_(scale)
                p.grad = g
            else:
                p.grad = _as_grad(p, grads[n])
        self.opt.step()
        for p in self.params.values():
            p.grad = None
        self.current = (self.current[0] + 1, self.publish())

    def snapshot(self, step: int) -> ShardSnapshot:
        sd = self.opt.state_dict()
        state = {k: {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in s.items()} for k, s in sd["state"].items()}
        return ShardSnapshot(
            step=step,
            version=self.version,
            params={n: p.detach().to("cpu", copy=True) for n, p in self.params.items()},
            optimizer={"state": state, "param_groups": sd["param_groups"]},
        )


def _as_grad(p: torch.Tensor, payload: Payload) -> torch.Tensor:
    """A dense payload of the parameter's dtype and device is used as it is (torch's
    optimizers only read gradients); anything else is decompressed into a new tensor."""
    if isinstance(payload, torch.Tensor) and payload.dtype == p.dtype and payload.device == p.device and payload.is_contiguous():
        return payload.view_as(p)
    g = torch.empty_like(p)
    decompress_into(g, payload, add=False)
    return g


@keep_alive
@immovable
@reentrant
@hash_placement
class ParamShardGrain(Grain):
    State = SnapshotState

    def __init__(self) -> None:
        self._cfg: ShardConfig | None = None
        self._core: _Core | None = None
        self._generation = -1
        self._mode = "sync"
        self._staleness = 0
        self._every = 0
        self._next: list[int] = []  # per slot: next step expected (taken pushes)
        self._applied: list[int] = []  # per slot: next step whose push is not yet applied
        self._acc_step = -1
        self._acc_slots: set[int] = set()
        self._next_ckpt = 0
        self._saved: list[int] = []
        self._changed = asyncio.Condition()
        self._lock = asyncio.Lock()
        self._pushes = self._duplicates = self._bytes_in = self._bytes_out = 0
        self._max_staleness = self._max_gap = 0

    # --- configuration ------------------------------------------------------
    async def configure(self, cfg: ShardConfig) -> ShardStatus:
        """Start (or restart) this shard for a generation: seeded weights or a checkpoint."""
        async with self._changed:
            self._generation = cfg.generation  # older callers wake up and leave
            self._changed.notify_all()
        snapshot = None
        if cfg.restore_step is not None:
            snapshot = await checkpointing.load(self, cfg.job, cfg.run, cfg.restore_step, cfg.names)
        async with self._lock:
            core = await self.run_in_thread(_Core, cfg, self.device, snapshot)
            start = cfg.restore_step or 0
            self._cfg, self._core = cfg, core
            self._mode, self._staleness, self._every = cfg.spec.mode, cfg.spec.staleness, cfg.spec.checkpoint_every
            self._next = [start] * cfg.slots
            self._applied = [start] * cfg.slots
            self._acc_step, self._acc_slots = -1, set()
            self._next_ckpt = (start // self._every + 1) * self._every if self._every else 0
            self._saved = [cfg.restore_step] if cfg.restore_step is not None else []
        async with self._changed:
            self._changed.notify_all()
        return await self.status()

    async def stop(self, generation: int) -> None:
        """Refuse further exchanges of older generations (the job ended or was cancelled)."""
        async with self._changed:
            self._generation = max(self._generation, generation)
            self._changed.notify_all()

    # --- the step path ------------------------------------------------------
    async def exchange(
        self,
        generation: int,
        slot: int,
        step: int,
        grads: dict[str, Payload] | None,
        base_version: int,
        have_version: int,
    ) -> ExchangeReply:
        """Push ``grads`` of ``(slot, step)`` (None: pull only), then return what the mode allows."""
        self._check(generation)
        staleness = 0
        if grads is not None:
            # Shielded: a push the shard has taken is applied whole even if the caller gives up
            # (a restarted trainer's retry is then a duplicate, never half a step).
            staleness = await asyncio.shield(self._push(generation, slot, step, grads, base_version))
        gap = await self._wait_turn(generation, slot, step + (grads is not None))
        core = self._core
        assert core is not None
        version, published = core.current
        params = None
        if version != have_version:
            params = published
            self._bytes_out += sum(t.numel() * t.element_size() for t in params.values())
        return ExchangeReply(version=version, params=params, staleness=staleness, gap=gap)

    def _check(self, generation: int) -> None:
        if generation != self._generation or self._core is None:
            raise StaleGenerationError(
                f"{self.key} is at generation {self._generation}, the call is of generation {generation}"
            )

    async def _push(self, generation: int, slot: int, step: int, grads: dict[str, Payload], base: int) -> int:
        if step < self._next[slot]:
            self._duplicates += 1
            return 0
        if self._mode == "sync" and step != self._next[slot]:
            raise StaleGenerationError(f"{self.key}: slot {slot} pushed step {step}, expected {self._next[slot]}")
        self._next[slot] = step + 1
        self._pushes += 1
        self._bytes_in += sum(payload_nbytes(p) for p in grads.values())
        core = self._core
        assert core is not None
        if self._mode == "sync":
            async with self._lock:
                self._check(generation)
                first = self._acc_step != step
                if first:
                    self._acc_step, self._acc_slots = step, set()
                last = len(self._acc_slots | {slot}) == len(self._next)
                # One thread hop: the push that completes the step also applies it.
                await self.run_in_thread(core.push_sync, grads, first, 1.0 / len(self._next) if last else None)
                self._acc_slots.add(slot)
                self._applied[slot] = step + 1
                if last:
                    await self._maybe_snapshot(core)
            staleness = 0
        else:
            await self._wait_for_checkpoint(generation, step)
            async with self._lock:
                self._check(generation)
                staleness = core.version - base if base >= 0 else 0
                await self.run_in_thread(core.apply, grads, 1.0)
                self._applied[slot] = step + 1
                await self._maybe_snapshot(core)
        self._max_staleness = max(self._max_staleness, staleness)
        async with self._changed:
            self._changed.notify_all()
        return staleness

    def _done_step(self) -> int:
        """Every push of a step below this is applied."""
        return min(self._applied)

    async def _maybe_snapshot(self, core: _Core) -> None:
        # Called under self._lock, right after an apply: nothing else can change the tensors.
        if not self._every or self._done_step() < self._next_ckpt:
            return
        if self._mode == "sync" and self._acc_step >= self._next_ckpt and len(self._acc_slots) < len(self._next):
            return  # a later step is half accumulated; cannot happen in sync, kept as a guard
        step = self._next_ckpt
        snap = await self.run_in_thread(core.snapshot, step)
        self._next_ckpt += self._every
        generation = self._generation
        self.start_task(self._save(snap, generation), name=f"{self.key} checkpoint {step}")

    async def _save(self, snap: ShardSnapshot, generation: int) -> None:
        cfg = self._cfg
        assert cfg is not None
        try:
            await checkpointing.save(self, cfg.job, cfg.run, snap, cfg.shard_keys, cfg.spec.keep_checkpoints)
        except Exception:
            log.exception("%s: saving checkpoint %d failed", self.key, snap.step)
            return
        if generation == self._generation:
            self._saved = [*self._saved, snap.step][-10:]

    async def _wait_for_checkpoint(self, generation: int, step: int) -> None:
        """async/ssp: a push of step >= the next checkpoint waits until that checkpoint is taken."""
        if not self._every:
            return
        async with self._changed:
            while step >= self._next_ckpt:
                self._check(generation)
                await self._changed.wait()

    async def _wait_turn(self, generation: int, slot: int, next_step: int) -> int:
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
            silo=str(self.silo),
        )

    async def parameters(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights (a copy)."""
        core = self._core
        if core is None:
            return {}
        async with self._lock:
            return {n: p.detach().to("cpu", copy=True) for n, p in core.params.items()}

    async def export_state(self) -> ShardSnapshot | None:
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
