"""Running seeds: the process-wide seams made deterministic, failures shrunk, digests summed.

A seed must replay the same run in any process. The runtime reads a few
things outside the event loop, and :func:`deterministic` makes each follow
the seed for the length of one run: ``random``'s global generator (the
router's back-off jitter), ``uuid.uuid4`` (activation ids, etags) and the
clocks ``time.time`` / ``time.monotonic`` / ``time.perf_counter`` (read
here and there for stamps and ages), which then read the loop's virtual
time. String hashing (``PYTHONHASHSEED``) orders sets of strings; the
command line fixes it before Python starts (``__main__`` re-executes itself
when it is not set), so a digest printed by one run is the digest of any.
"""

from __future__ import annotations

import contextlib
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from silo.testing.sim.grains import WORLD
from silo.testing.sim.world import SCENARIOS, Fault, Outcome, Scenario, run_world

EPOCH = 1_800_000_000.0
"""What ``time.time()`` reads at virtual time zero (a fixed date, so stamps replay too)."""


@contextlib.contextmanager
def deterministic(seed: int) -> Iterator[None]:
    import asyncio

    rng = random.Random(seed ^ 0x00D1CE)
    saved = (random.getstate(), uuid.uuid4, time.time, time.monotonic, time.perf_counter)

    def clock() -> float:
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return 0.0

    random.seed(seed)
    uuid.uuid4 = lambda: uuid.UUID(int=rng.getrandbits(128), version=4)  # type: ignore[assignment]
    # The wall clock of the silo whose code runs: it may have jumped (a "clock_jump" fault).
    time.time = lambda: EPOCH + clock() + _wall_offset()  # type: ignore[assignment]
    time.monotonic = time.perf_counter = clock  # type: ignore[assignment]
    try:
        yield
    finally:
        state, uuid.uuid4, time.time, time.monotonic, time.perf_counter = saved  # type: ignore[misc]
        random.setstate(state)


def _wall_offset() -> float:
    world = WORLD.get(None)
    return 0.0 if world is None else world.wall_offset()


def scenario_for(seed: int, name: str | None) -> Scenario:
    """The named scenario, or the one the seed picks (seeds cycle through those in the rotation)."""
    if name is not None:
        return SCENARIOS[name]
    names = sorted(n for n, s in SCENARIOS.items() if s.in_rotation)
    return SCENARIOS[names[seed % len(names)]]


def run_seed(seed: int, scenario: Scenario, *, faults: list[Fault] | None = None, shuffle: bool = True) -> Outcome:
    with deterministic(seed):
        return run_world(seed, scenario, faults=faults, shuffle=shuffle)


@dataclass(frozen=True, slots=True)
class Shrunk:
    faults: list[Fault]
    outcome: Outcome


def shrink(seed: int, scenario: Scenario, failed: Outcome, *, budget: int = 12) -> Shrunk:
    """Drop faults one at a time while the run still breaks the same invariant (at most ``budget`` runs)."""
    invariant = failed.violation.invariant
    faults = list(failed.faults)
    best = failed
    i = 0
    while i < len(faults) and budget > 0:
        trial = faults[:i] + faults[i + 1 :]
        budget -= 1
        out = run_seed(seed, scenario, faults=trial)
        if out.violation is not None and out.violation.invariant == invariant:
            faults, best = trial, out
        else:
            i += 1
    return Shrunk(faults, best)
