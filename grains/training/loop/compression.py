"""Gradient compression with error feedback, and the pull format that goes with it.

``none`` sends fp32 gradients; ``fp16`` / ``bf16`` send them rounded to half
precision; ``topk:<ratio>`` sends only the largest ``ratio`` of each tensor's
entries (values fp32, indices int32), and ``topk:<ratio>:fp16`` the same
entries with their values rounded to fp16 (6 bytes per kept entry instead of
8). Every lossy kind keeps the part it did not send (the residual) and adds it
to the next step's gradient, so nothing is lost, only delayed: error feedback,
which is what keeps top-k within a point of uncompressed accuracy. For top-k
with fp16 values the residual keeps the entries not chosen and the rounding
error of the ones sent, so the rounding is fed back like the rest.

A trainer saves its residual at every checkpoint step and a trainer restarted
from that checkpoint resumes with it, so a run rolled back to a checkpoint
replays exactly as it first ran (see trainer.py).

Pulls follow the push kind: with any compression the shard sends parameters as
fp16 (bf16 for ``bf16``) instead of fp32. Pushes shrink with the compression
and pulls halve, so top-k 1% moves about a quarter of the bytes of ``none``
(the pulls then dominate: fp16 values shave only the pushes' quarter of that).
"""

from __future__ import annotations

import torch

from grains.training.api.job import CompressionSpec

Payload = torch.Tensor | list[torch.Tensor]
"""One tensor's gradient on the wire: a dense tensor, or ``[values, indices]`` for top-k."""


# The largest finite fp16: a top-k value beyond it is sent clamped (the excess stays in
# the residual) rather than as inf, which would poison the shard's parameters.
_FP16_MAX = float(torch.finfo(torch.float16).max)


def payload_nbytes(payload: Payload | None) -> int:
    if payload is None:
        return 0
    if isinstance(payload, torch.Tensor):
        return payload.nbytes
    return sum(t.nbytes for t in payload)


class Compressor:
    """Compresses one trainer's gradients, keeping a residual per tensor (error feedback)."""

    def __init__(self, spec: CompressionSpec) -> None:
        self.spec = spec
        self._residual: dict[str, torch.Tensor] = {}

    @property
    def lossy(self) -> bool:
        return self.spec.kind != "none"

    def residual(self) -> dict[str, torch.Tensor]:
        """What has not been sent yet, per tensor. Entries are replaced, never written to,
        by later steps, so the tensors may be read (saved) while training goes on."""
        return dict(self._residual)

    def restore(self, residual: dict[str, torch.Tensor]) -> None:
        self._residual = dict(residual)

    def add_residual(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each gradient plus its residual, in place: the error-compensated gradients, which
        :meth:`compress` then sends as they are. A trainer that clips clips these, so what is
        sent (and applied) stays within the bound; clipping before the residual was added back
        did not bound it."""
        for n, g in grads.items():
            res = self._residual.pop(n, None)
            if res is not None:
                g.add_(res)
        return grads

    def compress(self, name: str, grad: torch.Tensor) -> Payload:
        kind = self.spec.kind
        if kind == "none":
            return grad
        res = self._residual.get(name)
        g = grad if res is None else grad.add_(res)
        if kind in ("fp16", "bf16"):
            # fp16 overflows to inf past 65504, and an inf would stay in the residual for good:
            # clamp, and the excess waits in the residual like any rounding error.
            sent = g.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16) if kind == "fp16" else g.to(torch.bfloat16)
            self._residual[name] = g.sub_(sent.float())
            return sent
        flat = g.reshape(-1)
        k = max(1, int(flat.numel() * self.spec.ratio))
        idx = torch.topk(flat.abs(), k, sorted=False).indices
        values = flat[idx]
        if self.spec.value_dtype == torch.float32:
            flat[idx] = 0.0  # what was sent leaves the residual
            sent = values
        else:
            sent = values.clamp(-_FP16_MAX, _FP16_MAX).to(self.spec.value_dtype)
            flat[idx] = values - sent.float()  # only the rounding error stays behind
        self._residual[name] = g
        return [sent, idx.to(torch.int32)]


def decompress_into(target: torch.Tensor, payload: Payload, *, add: bool) -> None:
    """Write (``add=False``) or add (``add=True``) a gradient payload into a dense fp32 tensor;
    values of any float dtype (fp32, fp16, bf16) are converted to the target's."""
    if isinstance(payload, torch.Tensor):
        src = payload.to(target.device, target.dtype).view_as(target)
        target.add_(src) if add else target.copy_(src)
        return
    values, idx = payload
    flat = target.view(-1)
    if not add:
        flat.zero_()
    flat.index_add_(0, idx.to(target.device, torch.int64), values.to(target.device, target.dtype))
