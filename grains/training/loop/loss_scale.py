"""Dynamic fp16 loss scaling as a value with state, the same in every mode.

``torch.amp.GradScaler`` unscales only into an optimizer's ``step``; a
parameter-server trainer has no optimizer (its shards do), and all-reduce
ranks must agree on one factor, or the group's mean mixes gradients scaled
by different ones (measured: ranks 1e-2 apart after one step once a joiner
came with a fresh GradScaler). :class:`LossScaler` keeps GradScaler's rule and
defaults (scale 2**16, halved on an overflow, doubled after 2000 clean steps)
and leaves *which* gradients it unscales to the mode: a trainer's own, or the
group's mean, which is the same tensor on every rank, so every rank takes the
same decision and stays bit-identical. Its :meth:`state_dict` travels in every
mode's snapshot, so a restored or joining holder continues with the scale the
others have.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class LossScaler:
    """The scale, and the count of clean steps since it last changed."""

    def __init__(
        self, init_scale: float = 2.0**16, growth_interval: int = 2000, growth_factor: float = 2.0, backoff_factor: float = 0.5
    ) -> None:
        self.scale = float(init_scale)
        self.growth_tracker = 0
        self._interval = growth_interval
        self._growth = growth_factor
        self._backoff = backoff_factor

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, grads: Iterable[torch.Tensor]) -> bool:
        """Divide ``grads`` by the scale in place; True when any of them holds an inf or a NaN."""
        grads = [g for g in grads if g is not None]
        if not grads:
            return False
        inv = 1.0 / self.scale
        torch._foreach_mul_(grads, inv)
        # One read of the device for the whole step, not one per tensor.
        return not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    def update(self, overflow: bool) -> None:
        """GradScaler's rule: back off on an overflow, grow after ``growth_interval`` clean steps."""
        if overflow:
            self.scale *= self._backoff
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self._interval:
            self.scale *= self._growth
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, float]:
        """GradScaler's keys for the two values that change."""
        return {"scale": self.scale, "growth_tracker": float(self.growth_tracker)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        if state:
            self.scale = float(state["scale"])
            self.growth_tracker = int(state["growth_tracker"])
