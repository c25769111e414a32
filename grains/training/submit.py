"""The submit-time check: a job is built and tried once before anything is placed.

:func:`check_job` goes beyond the spec's field validation: it imports the
model, dataset, step, evaluation, collate and callback paths, builds the
model, runs one step and one evaluation batch, so an unknown import path, a
model that does not fit the data or a step that breaks its contract fails
with a ConfigError at submit time, not minutes later on some silo.
"""

from __future__ import annotations

import torch

from grains.training.api.callbacks import Callbacks
from grains.training.api.job import TrainingJob
from grains.training.data.batches import Batches, batch_samples, collate_function, job_batches
from grains.training.datasets import dataset_size, load_dataset
from grains.training.loggers import check_loggers
from grains.training.loop.optim import (
    build_optimizer,
    build_schedule,
    check_param_groups,
    trainable,
)
from grains.training.loop.program import Program, check_program
from grains.training.models import build_model
from grains.training.state.init_weights import read_init, read_init_optimizer
from grains.training.state.model_tensors import ModelLayout, layout_of
from grains.training.strategies.pipeline.partition import check_cut
from silo.errors import ConfigError


def check_job(spec: TrainingJob) -> ModelLayout:
    """Resolve every import path, build the model, run one step and one evaluation batch.

    Raises ConfigError with the reason when a path does not resolve, a factory
    fails, a parameter-group glob matches nothing, the optimizer or schedule
    cannot be built, ``init_from`` does not fit the model, or the step or
    evaluation breaks its contract on the first batch.
    """
    train_set = load_dataset(spec, "train")
    total = spec.total_steps(dataset_size(train_set), 1)  # a stream without a length needs `steps`
    train = Batches(train_set, workers=spec.loader_workers, collate_fn=collate_function(spec))  # workers with a stream: refused here
    test = job_batches(spec, "test")
    model = build_model(spec)
    layout = layout_of(model)
    check_param_groups(model, spec)
    opt = build_optimizer(trainable(model), spec)
    build_schedule(opt, spec, total)
    if spec.init_from is not None:
        model.load_state_dict(read_init(spec.init_from, model), strict=True)
        if spec.init_optimizer and opt is not None:
            read_init_optimizer(spec.init_from, model, opt)
    Callbacks(spec.callbacks)  # their import paths and constructors, at submit
    check_loggers(spec)
    program = Program.of(spec)
    with torch.random.fork_rng(devices=[]):
        try:
            train_batch = train.batch(spec.trainer_batch, 1, 0, 0, spec.seed)
            test_batch = next(iter(test.eval_batches(min(spec.eval_batch_size, 64))))
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user dataset may raise anything
            raise ConfigError(f"dataset {spec.dataset}: reading the first batch failed: {type(exc).__name__}: {exc}") from None
        if spec.mode == "pipeline":
            # An nn.Sequential with at least `stages` layers, or split points torch.fx can cut at,
            # whose stages run one after another on a micro-batch.
            check_cut(model, spec, _first_input(train_batch)[: max(1, spec.batch_size // spec.microbatches)])
        check_program(program, model, train_batch, test_batch, batch_samples)
    return layout


def _first_input(batch: object) -> torch.Tensor:
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor):
        return batch[0]
    raise ConfigError(f"pipeline mode takes (input, target) batches whose input is a tensor, not {type(batch).__name__}")
