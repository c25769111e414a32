"""The tensors and the update rule of one parameter shard configuration (its grain: shard.py).

:class:`ShardCore` holds a shard's fp32 master weights, its frozen
parameters and buffers, the job's optimizer and schedule over its slice, the
sum of the current sync step's pushes, and the published copy trainers pull.
Its methods run on the silo's executor, one at a time (the grain holds its
lock around each); the grain decides when to call them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch._utils import _unflatten_dense_tensors

from grains.immutable import immutable
from grains.training.api.job import parse_compression
from grains.training.api.messages import ShardConfig
from grains.training.loop.compression import Payload, decompress_into
from grains.training.loop.optim import (
    advance,
    build_optimizer,
    build_schedule,
    squared_norm,
    step_schedule,
    sync_rates,
)
from grains.training.models import build_model
from grains.training.state.checkpoint import TrainingSnapshot
from grains.training.state.model_tensors import persistent_buffers
from grains.training.state.optimizer_state import load_optimizer_state, optimizer_state


class ShardCore:
    """The tensors of one configuration; its methods run on the silo's executor."""

    def __init__(self, cfg: ShardConfig, device: str, snapshot: TrainingSnapshot | None) -> None:
        spec = cfg.spec
        if snapshot is not None and cfg.kinds is not None:
            # Restoring, with the kinds of the shard's tensors known: the checkpoint holds every
            # value, so no model is built (a shard built the whole model for its slice, twice).
            self.frozen_names, self.buffer_names = list(cfg.kinds.frozen), list(cfg.kinds.buffers)
            held = set(self.frozen_names) | set(self.buffer_names)
            self.names = [n for n in cfg.names if n not in held]
            named: dict[str, torch.Tensor] = {n: snapshot.params[n] for n in self.names}
            named.update({n: snapshot.buffers[n] for n in self.frozen_names})
            buffers = {n: snapshot.buffers[n] for n in self.buffer_names}
        else:
            model = build_model(spec)
            params = dict(model.named_parameters())
            named = dict(params)
            buffers = dict(persistent_buffers(model))
            own = set(cfg.names)
            self.names = [n for n, p in params.items() if n in own and p.requires_grad]
            self.frozen_names = [n for n, p in params.items() if n in own and not p.requires_grad]
            self.buffer_names = [n for n in buffers if n in own]
        self._flat, views = _flattened([named[n] for n in self.names], device)
        self.params = {n: nn.Parameter(v) for n, v in zip(self.names, views, strict=True)}
        """Trainable parameters, model order (the optimizer's order): views of one fp32 buffer,
        which :meth:`publish` copies in one operation."""
        self.buffers = {n: _fp32(buffers[n]).to(device, copy=True) for n in self.buffer_names}
        self.frozen = {n: _fp32(named[n].detach()).to(device, copy=True) for n in self.frozen_names}
        self.device = next(iter(self.params.values())).device if self.params else torch.device(device)
        """The parameters' device, as their tensors name it ("cuda:0" for "cuda")."""
        self.opt = build_optimizer(list(self.params.items()), spec)
        self.schedule = build_schedule(self.opt, spec, cfg.end_step or None)
        self.schedule_step = 0
        self.clip = spec.clip_grad_norm
        self.pull_dtype = parse_compression(spec.compression).pull_dtype
        self.acc: dict[str, torch.Tensor] = {}
        self._held: dict[str, Payload] | None = None  # the step's first push, not yet summed
        self.buf_acc: dict[str, torch.Tensor] = {}
        self.skip = False
        """A trainer flagged the step being summed as skipped."""
        self.skipped = 0
        version = 0
        if snapshot is not None:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(snapshot.params[n])
                for n, t in {**self.buffers, **self.frozen}.items():
                    t.copy_(snapshot.buffers[n])
            # A fresh schedule stepped to the restored step gives the rate every holder has
            # there; the optimizer's saved groups (loaded after) agree with it.
            advance(self.schedule, snapshot.step)
            self.schedule_step = snapshot.step
            load_optimizer_state(self.opt, list(self.params.items()), snapshot.optimizer)
            sync_rates(self.opt, self.schedule)  # the job's length may have changed since
            # The step-number rule: a holder restored at step c has applied c global steps,
            # whichever mode saved it (an async shard's own count of pushes stays its own).
            version = snapshot.step
        self.current: tuple[int, dict[str, torch.Tensor]] = (version, self.publish())
        """The version and its parameters in the pull dtype, replaced in one assignment: updates
        run on the executor while the event loop answers pulls, which must never pair a new
        version with the old tensors (a sync trainer would then compute on stale weights)."""
        self.published_nbytes = sum(t.nbytes for t in self.current[1].values())
        """Bytes of every version's parameters and buffers (the same tensors, fresh copies)."""
        self.compensation = spec.delay_compensation if spec.mode != "sync" and _has_second_moment(self.opt) else 0.0
        """DC-ASGD's lambda for async/ssp pushes (:func:`compensated`); 0: pushes are applied as sent."""

    @property
    def version(self) -> int:
        return self.current[0]

    def publish(self) -> dict[str, torch.Tensor]:
        """Fresh copies of the parameters in the pull dtype and of the buffers (callers may
        hold them by reference)."""
        dtype = self.pull_dtype
        # One copy of the flat buffer and its views, not a copy a tensor: the tiny BERT's 41
        # took 95 µs of the event loop a step, these two operations ~15.
        flat = self._flat.clone() if dtype is torch.float32 else self._flat.to(dtype)
        out = dict(zip(self.names, _unflatten_dense_tensors(flat, list(self.params.values())), strict=True))
        with torch.no_grad():
            out.update({n: b.clone() for n, b in self.buffers.items()})
        for t in out.values():  # never written again: a trainer on this silo takes them by reference
            immutable(t)
        return out

    def frozen_payload(self) -> dict[str, torch.Tensor]:
        # Frozen tensors never change (the optimizer does not hold them): passed by reference too.
        return {n: immutable(t.to(self.pull_dtype) if t.is_floating_point() else t) for n, t in self.frozen.items()}

    def accumulate(self, grads: dict[str, Payload], buffers: dict[str, torch.Tensor] | None, skip: bool, first: bool) -> None:
        if first:
            self.skip, self.buf_acc = False, {}
        self.skip = self.skip or skip
        if buffers:
            for n in self.buffer_names:
                b = buffers[n]
                if not b.is_floating_point():
                    self.buf_acc[n] = b
                elif n in self.buf_acc:
                    self.buf_acc[n].add_(b.to(self.buf_acc[n].device, torch.float32))
                else:
                    self.buf_acc[n] = b.to(self.buffers[n].device, torch.float32, copy=True)
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
            first_push: Payload = held[n]
            second: Payload = grads[n]
            if (
                isinstance(first_push, torch.Tensor) and isinstance(second, torch.Tensor)
                and first_push.dtype == second.dtype == acc.dtype
            ):  # fmt: skip
                torch.add(first_push, second, out=acc)
            else:
                decompress_into(acc, first_push, add=False)
                decompress_into(acc, second, add=True)

    def summed(self, scale: float) -> dict[str, torch.Tensor]:
        """The step's gradient sum times ``scale`` (a single push: that push), as gradients."""
        held, self._held = self._held, None
        if held is not None:  # one trainer: nothing was summed
            grads = {n: _as_grad(p, held[n], self.device) for n, p in self.params.items()}
            if scale != 1.0:
                grads = {n: g * scale for n, g in grads.items()}
            return grads
        for g in self.acc.values():
            if scale != 1.0:
                g.mul_(scale)
        return dict(self.acc)

    def push_sync(
        self, grads: dict[str, Payload], buffers: dict[str, torch.Tensor] | None, skip: bool, first: bool, scale: float | None, step: int
    ) -> None:
        """Add one trainer's push to the step's sum; with ``scale`` (the last trainer), apply the mean."""
        self.accumulate(grads, buffers, skip, first)
        if scale is not None:
            self.finish_step(self.summed(scale), scale, step + 1)

    def pending_norm_sq(self, scale: float) -> tuple[dict[str, torch.Tensor], float]:
        """The step's mean gradient and its squared norm (this shard's part of the global norm)."""
        grads = self.summed(scale)
        return grads, (math.inf if self.skip else squared_norm(grads.values()))

    def finish_step(self, grads: dict[str, torch.Tensor], buffer_scale: float, global_step: int, coef: float = 1.0) -> None:
        """Apply a sync step: the mean gradient (times the clip coefficient) and the mean buffers."""
        if not self.skip:
            with torch.no_grad():
                for n, b in self.buf_acc.items():
                    if b.is_floating_point():
                        self.buffers[n].copy_(b.mul_(buffer_scale))
                    else:
                        self.buffers[n].copy_(b)
        self.buf_acc = {}
        self.step_optimizer(grads, coef, skip=self.skip, global_step=global_step)

    def apply_push(
        self, grads: dict[str, Payload], buffers: dict[str, torch.Tensor] | None, skip: bool, global_step: int, lr_scale: float = 1.0,
        pulled: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """async / ssp: one push applied alone (its buffers replace the shard's); ``pulled``: the
        parameters its gradients were computed on, when they are not the current ones."""
        if not skip and buffers:
            with torch.no_grad():
                for n in self.buffer_names:
                    self.buffers[n].copy_(buffers[n])
        dense = {n: _as_grad(p, grads[n], self.device) for n, p in self.params.items()}
        if self.compensation and pulled is not None and not skip and self.opt is not None:
            dense = compensated(self.opt, self.params, dense, pulled, self.compensation)
        self.step_optimizer(dense, 1.0, skip=skip, global_step=global_step, lr_scale=lr_scale)

    def step_optimizer(
        self, grads: dict[str, torch.Tensor], coef: float, *, skip: bool, global_step: int, lr_scale: float = 1.0
    ) -> None:
        if skip:
            self.skipped += 1
        elif self.opt is not None:
            for n, p in self.params.items():
                g = grads[n]
                p.grad = g.mul_(coef) if coef != 1.0 else g
            with scaled_lr(self.opt, lr_scale):
                self.opt.step()
            for p in self.params.values():
                p.grad = None
        while self.schedule_step < global_step:  # once per global step, whatever happened to it
            step_schedule(self.schedule)
            self.schedule_step += 1
        self.current = (self.current[0] + 1, self.publish())

    def snapshot(self, step: int) -> TrainingSnapshot:
        return TrainingSnapshot(
            step=step,
            version=step,
            params={n: p.detach().to("cpu", copy=True) for n, p in self.params.items()},
            optimizer=optimizer_state(self.opt, list(self.params.items())),
            buffers={n: t.detach().to("cpu", copy=True) for n, t in {**self.buffers, **self.frozen}.items()},
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        """fp32 parameters (trainable and frozen) and buffers, CPU copies."""
        out = {n: p.detach().to("cpu", copy=True) for n, p in self.params.items()}
        out.update({n: t.detach().to("cpu", copy=True) for n, t in {**self.frozen, **self.buffers}.items()})
        return out


def _has_second_moment(opt: torch.optim.Optimizer | None) -> bool:
    """Adam, AdamW, NAdam, RAdam (and subclasses) keep ``exp_avg_sq``, the per-weight gradient
    scale :func:`compensated` divides by; other optimizers' pushes are applied as sent."""
    return isinstance(opt, torch.optim.Adam | torch.optim.AdamW | torch.optim.NAdam | torch.optim.RAdam)


def compensated(
    opt: torch.optim.Optimizer, params: dict[str, nn.Parameter], grads: dict[str, torch.Tensor],
    pulled: dict[str, torch.Tensor], strength: float,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """A stale gradient carried to the current weights: ``g + lambda * g*g / sqrt(v) * (w - w_pulled)``.

    DC-ASGD (Zheng et al., "Asynchronous SGD with delay compensation", ICML 2017): the gradient
    at the current weights ``w`` is about the pushed one, computed at ``w_pulled``, plus the
    Hessian times the step between them; ``g*g`` approximates the Hessian's diagonal, and the
    adaptive form (DC-ASGD-a) divides it by the root of the gradient's running mean square, here
    Adam's own bias-corrected ``exp_avg_sq`` (so ``lambda`` is scale-free: the paper's 2).
    New tensors: the pushed ones may be a trainer's, passed by reference. A parameter with no
    optimizer state yet (the first push) or no pulled copy is left as pushed.
    """
    out = dict(grads)
    by_id = {id(p): n for n, p in params.items()}
    with torch.no_grad():
        for group in opt.param_groups:
            beta2 = group["betas"][1]
            eps = group["eps"]
            for p in group["params"]:
                state = opt.state.get(p, {})
                v = state.get("exp_avg_sq")
                name = by_id.get(id(p))
                if v is None or name is None or name not in pulled:
                    continue
                g = grads[name]
                v_hat = v / (1 - beta2 ** float(state["step"]))
                hessian = g * g / (v_hat.sqrt() + eps)
                out[name] = g + strength * hessian * (p - pulled[name].to(p.dtype))
    return out


@contextlib.contextmanager
def scaled_lr(opt: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Every param group's lr times ``factor`` for one step, restored after (also on an error):
    the schedule and the checkpoints see the job's rate."""
    if factor == 1.0:
        yield
        return
    lrs = [group["lr"] for group in opt.param_groups]
    for group in opt.param_groups:
        group["lr"] = group["lr"] * factor
    try:
        yield
    finally:
        for group, lr in zip(opt.param_groups, lrs, strict=True):
            group["lr"] = lr


def _flattened(tensors: list[torch.Tensor], device: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A new fp32 buffer on ``device`` holding ``tensors`` end to end, and its views shaped like
    each (torch's own helper, as DDP's bucketing uses it)."""
    if not tensors:
        return torch.empty(0, device=device), []
    flat = torch.cat([t.detach().to(device, torch.float32).reshape(-1) for t in tensors])
    return flat, list(_unflatten_dense_tensors(flat, tensors))


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32) if t.is_floating_point() else t.detach()


def _as_grad(p: torch.Tensor, payload: Payload, device: torch.device) -> torch.Tensor:
    """A dense payload of the parameter's dtype and ``device`` (the parameters') is used as it
    is (torch's optimizers only read gradients); anything else is decompressed into a new tensor."""
    if isinstance(payload, torch.Tensor) and payload.dtype is p.dtype and payload.device == device and payload.is_contiguous():
        return payload if payload.shape == p.shape else payload.view_as(p)
    g = torch.empty_like(p)
    decompress_into(g, payload, add=False)
    return g
