"""A step's random draws as a function of (job seed, step, trainer): any checkpoint resumes them.

Dropout masks and whatever else a step draws from torch's default generator
used to depend on everything the process had drawn before: a job rolled back
or resumed from checkpoint ``c`` drew other masks after ``c`` than the run
that first trained past it, so a resume was not the run it replaced. Saving
each trainer's generator state in its checkpoints (what HF's Trainer does,
``rng_state_{rank}.pth``) restores it only for the same trainer count and
mode. Instead, before each step the generator of the trainer's device (and
the CPU's) is seeded with a mix of the job's ``seed``, the global step and
the trainer's rank (and, in a pipeline, the stage and micro-batch): the
state at every step is a pure function of where the job is, so nothing needs
saving, and a checkpoint resumes with the draws the first run made, in any
mode that keeps the ranks (as the data position keeps the samples).

Torch's default generator is one per process, and trainers that share a
silo process (several trainers or stages on one silo, or a test cluster of
in-process silos) run their steps in threads at once: seeding alone, one
thread's seed would land in another's forward. So the seed and the forward
that draws (:func:`draws`) hold one lock of the process: forwards of threads
in one process take turns (their backwards, most of a step, do not), and
each draws its own stream. A trainer alone in its process never waits; on a
GPU the lock is held while the kernels are queued, not while they run.
Python's ``random`` and numpy's global generator are the silo's own (its
placement and backoff draw from them): a step that wants them seeded uses
``ctx.step`` and ``ctx.rank``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_MASK = (1 << 64) - 1
_GENERATOR = threading.Lock()
"""Torch's default generators are the process's: one lock of the process guards them (a lock per
silo would not, with several silos in one process)."""


def _mix(x: int) -> int:
    """SplitMix64's finalizer: nearby inputs give unrelated 64-bit outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def step_seed(seed: int, step: int, rank: int, part: int = 0) -> int:
    """The seed of trainer ``rank``'s draws at global ``step`` (``part``: a pipeline's stage and
    micro-batch), a non-negative int below 2**63."""
    x = _mix(seed & _MASK)
    for v in (step, rank, part):
        x = _mix(x ^ (v & _MASK))
    return x >> 1


def seed_step(seed: int, step: int, rank: int, device: str = "cpu", part: int = 0) -> None:
    """Seed the CPU's default generator, and ``device``'s when it is a GPU, for this step.

    Through the generators themselves: ``torch.manual_seed`` looks for every accelerator
    on each call (0.25 ms here), the generator's own ``manual_seed`` takes 4 µs.
    """
    s = step_seed(seed, step, rank, part)
    torch.default_generator.manual_seed(s)
    if device.startswith("cuda"):
        dev = torch.device(device)
        torch.cuda.default_generators[dev.index if dev.index is not None else torch.cuda.current_device()].manual_seed(s)


@contextlib.contextmanager
def draws(seed: int, step: int, rank: int, device: str = "cpu", part: int = 0) -> Iterator[None]:
    """Run the block (a forward that may draw) with the generators seeded for this step and
    ``part``, no other thread of the process drawing meanwhile."""
    with _GENERATOR:
        seed_step(seed, step, rank, device, part)
        yield
