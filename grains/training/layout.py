"""What a model holds, by kind, and the submit-time check that builds it once.

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
every replica builds its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from grains.training.job import TrainingJob
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
    from grains.training.models import build_model

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


def check_job(spec: TrainingJob) -> ModelLayout:
    """Resolve every import path, build the model, run one step and one evaluation batch.

    Raises ConfigError with the reason when a path does not resolve, a factory
    fails, a parameter-group glob matches nothing, the optimizer or schedule
    cannot be built, ``init_from`` does not fit the model, or the step or
    evaluation breaks its contract on the first batch.
    """
    from grains.training.batches import Batches, batch_samples, collate_function, job_batches
    from grains.training.callbacks import Callbacks
    from grains.training.datasets import dataset_size, load_dataset
    from grains.training.init import read_init
    from grains.training.models import build_model
    from grains.training.optim import build_optimizer, build_schedule, check_param_groups, trainable
    from grains.training.program import Program, check_program

    train_set = load_dataset(spec, "train")
    spec.total_steps(dataset_size(train_set), 1)  # a stream without a length needs `steps`
    train = Batches(train_set, workers=spec.loader_workers, collate_fn=collate_function(spec))  # workers with a stream: refused here
    test = job_batches(spec, "test")
    model = build_model(spec)
    layout = layout_of(model)
    check_param_groups(model, spec)
    opt = build_optimizer(trainable(model), spec)
    build_schedule(opt, spec)
    if spec.init_from is not None:
        model.load_state_dict(read_init(spec.init_from, model), strict=True)
    Callbacks(spec.callbacks)  # their import paths and constructors, at submit
    program = Program.of(spec)
    with torch.random.fork_rng(devices=[]):
        try:
            train_batch = train.batch(spec.slot_batch, 1, 0, 0, spec.seed)
            test_batch = next(iter(test.eval_batches(min(spec.eval_batch_size, 64))))
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user dataset may raise anything
            raise ConfigError(f"dataset {spec.dataset}: reading the first batch failed: {type(exc).__name__}: {exc}") from None
        if spec.mode == "pipeline":
            from grains.training.pipeline import check_cut

            # An nn.Sequential with at least `stages` layers, or split points torch.fx can cut at,
            # whose stages run one after another on a micro-batch.
            check_cut(model, spec, _first_input(train_batch)[: max(1, spec.batch_size // spec.microbatches)])
        check_program(program, model, train_batch, test_batch, batch_samples)
    return layout


def _first_input(batch: object) -> torch.Tensor:
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor):
        return batch[0]
    raise ConfigError(f"pipeline mode takes (input, target) batches whose input is a tensor, not {type(batch).__name__}")
