"""What a model holds, by kind: its trainable and frozen parameters and its buffers.

A model's tensors are of three kinds, each treated its own way:

- *trainable* parameters (``requires_grad``): gradients are sent, the
  optimizer updates them;
- *frozen* parameters (``requires_grad=False``): never sent as gradients,
  never updated; their values come from the seeded model or ``init_from``;
- persistent *buffers* (BatchNorm's running statistics, anything from
  ``register_buffer``): updated by the trainers' forward passes, combined
  across trainers after every step (floating ones averaged, integer ones such
  as ``num_batches_tracked`` taken from one trainer: all trainers count the
  same), checkpointed, used in evaluation and exported.

Non-persistent buffers are not state (they are not in ``state_dict()``):
every trainer and stage builds its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from grains.training.api.job import TrainingJob
from grains.training.models import build_model
from silo.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ModelLayout:
    trainable: dict[str, int]
    """Bytes of each trainable parameter, in model order."""
    frozen: dict[str, int]
    buffers: dict[str, int]
    """Persistent buffers."""

    def sizes(self) -> dict[str, int]:
        return {**self.trainable, **self.frozen, **self.buffers}


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers ``state_dict()`` holds, by name, in model order."""
    out = []
    for module_name, module in model.named_modules():
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in skip:
                out.append((f"{module_name}.{name}" if module_name else name, buf))
    return out


def frozen_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if not p.requires_grad]


def layout_of(model: nn.Module) -> ModelLayout:
    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    return ModelLayout(
        trainable={n: nbytes(p) for n, p in model.named_parameters() if p.requires_grad},
        frozen={n: nbytes(p) for n, p in frozen_parameters(model)},
        buffers={n: nbytes(b) for n, b in persistent_buffers(model)},
    )


def model_layout(spec: TrainingJob) -> ModelLayout:
    """The layout of the job's model (built once; no step run: ``check_job`` did that at submit)."""
    return layout_of(build_model(spec))


def load_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy parameters and buffers by name into ``model`` (names it lacks are an error)."""
    own = {**dict(model.named_parameters()), **dict(persistent_buffers(model))}
    unknown = [n for n in tensors if n not in own]
    if unknown:
        raise ConfigError(f"the model has no tensors named {unknown[:5]}")
    with torch.no_grad():
        for n, t in tensors.items():
            own[n].copy_(t)


def export_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as fp32 (floating tensors), on the CPU, detached copies."""
    return {
        k: (v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype, copy=True))
        for k, v in model.state_dict().items()
    }
