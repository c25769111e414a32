"""Gradient compression with error feedback, and the pull format that goes with it.

``none`` sends fp32 gradients; ``fp16`` / ``bf16`` send them rounded to half
precision; ``topk:<ratio>`` sends only the largest ``ratio`` of each tensor's
entries (values fp32, indices int32). Every lossy kind keeps the part it did
not send (the residual) and adds it to the next step's gradient, so nothing is
lost, only delayed: error feedback, which is what keeps top-k within a point of
uncompressed accuracy.

A trainer saves its residual at every checkpoint step and a trainer restarted
from that checkpoint resumes with it, so a run rolled back to a checkpoint
replays exactly as it first ran (see trainer.py).

Pulls follow the push kind: with any compression the shard sends parameters as
fp16 (bf16 for ``bf16``) instead of fp32. Pushes shrink with the compression
and pulls halve, so top-k 1% moves about a quarter of the bytes of ``none``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from silo.errors import ConfigError

Payload = torch.Tensor | list[torch.Tensor]
"""One tensor's gradient on the wire: a dense tensor, or ``[values, indices]`` for top-k."""


@dataclass(frozen=True, slots=True)
class CompressionSpec:
    kind: Literal["none", "fp16", "bf16", "topk"]
    ratio: float = 1.0

    @property
    def pull_dtype(self) -> torch.dtype:
        """The dtype shards send parameters in for this compression."""
        return {"none": torch.float32, "bf16": torch.bfloat16}.get(self.kind, torch.float16)


def parse_compression(text: str) -> CompressionSpec:
    """``none`` | ``fp16`` | ``bf16`` | ``topk:<ratio>`` with 0 < ratio <= 1; ConfigError otherwise."""
    t = text.strip().lower()
    if t in ("none", "fp16", "bf16"):
        return CompressionSpec(t)  # type: ignore[arg-type]
    if t.startswith("topk:"):
        try:
            ratio = float(t[5:])
        except ValueError:
            ratio = -1.0
        if 0.0 < ratio <= 1.0:
            return CompressionSpec("topk", ratio)
    raise ConfigError(
        f"bad compression {text!r}: use none, fp16, bf16 or topk:<ratio> with 0 < ratio <= 1 (e.g. topk:0.01)"
    )


def payload_nbytes(payload: Payload | None) -> int:
    if payload is None:
        return 0
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return sum(t.numel() * t.element_size() for t in payload)


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

    def compress(self, name: str, grad: torch.Tensor) -> Payload:
        kind = self.spec.kind
        if kind == "none":
            return grad
        res = self._residual.get(name)
        g = grad if res is None else grad.add_(res)
        if kind in ("fp16", "bf16"):
            sent = g.to(torch.float16 if kind == "fp16" else torch.bfloat16)
            self._residual[name] = g.sub_(sent.float())
            return sent
        flat = g.reshape(-1)
        k = max(1, int(flat.numel() * self.spec.ratio))
        idx = torch.topk(flat.abs(), k, sorted=False).indices
        values = flat[idx]
        flat[idx] = 0.0  # what was sent leaves the residual
        self._residual[name] = g
        return [values, idx.to(torch.int32)]


def decompress_into(target: torch.Tensor, payload: Payload, *, add: bool) -> None:
    """Write (``add=False``) or add (``add=True``) a gradient payload into a dense fp32 tensor."""
    if isinstance(payload, torch.Tensor):
        src = payload.to(target.device, target.dtype).view_as(target)
        target.add_(src) if add else target.copy_(src)
        return
    values, idx = payload
    flat = target.view(-1)
    if not add:
        flat.zero_()
    flat.index_add_(0, idx.to(target.device, torch.int64), values.to(target.device, target.dtype))
