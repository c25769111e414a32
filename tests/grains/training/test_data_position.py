"""The data position counted in samples: resizes continue from the next unseen sample."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from grains.training import CoordinatorGrain, TrainingJob
from grains.training.api.job_state import JobState
from grains.training.data.batches import Batches, batch_indices
from grains.training.data.position import DataSchedule, Segment
from silo.errors import ConfigError
from tests.grains.training import data_ids
from tests.grains.training.conftest import (
    GRAINS,
    grown_at_a_gate,
    status_when,
    training_silos,
    wait_done,
)
from tests.grains.training.test_datasets import Counting


def values(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t]


def epochs_read(batches: Batches, b: int, segments: list[Segment], steps: int, seed: int) -> dict[int, list[int]]:
    """Every index each epoch gave out over ``steps`` steps, in order, all ranks."""
    schedule = batches.schedule(b, segments[0].trainers, segments)
    seen: dict[int, list[int]] = {}
    for t in range(steps):
        epoch, _, trainers = schedule.position(t)
        for j in range(trainers):
            seen.setdefault(epoch, []).extend(values(batches.indices(b, trainers, j, t, seed, segments)))
    return seen


def test_one_segment_gives_the_indices_of_the_closed_form() -> None:
    for n, b, k in [(23, 3, 2), (40, 4, 3), (1437, 64, 2), (10, 4, 3), (64, 8, 1)]:
        batches = Batches(TensorDataset(torch.arange(n)))
        one = [Segment(start_step=0, trainers=k)]
        for t in range(50):
            for j in range(k):
                want = batch_indices(n, b, k, j, t, seed=5)
                assert torch.equal(batches.indices(b, k, j, t, 5), want), (n, b, k, t, j)
                assert torch.equal(batches.indices(b, k, j, t, 5, one), want), (n, b, k, t, j)


def test_a_resize_mid_epoch_goes_on_from_the_next_unseen_sample() -> None:
    n, b = 100, 4
    schedule = DataSchedule.of(n, b, [], 1).resized(7, 3).resized(19, 2)  # 28 samples, then 12 and 8 a step
    assert schedule.position(7) == (0, 28, 3)
    assert schedule.position(13) == (1, 0, 3)  # 28 + 6 * 12 = 100: epoch 0 used up exactly
    assert schedule.position(19) == (1, 72, 2)
    assert schedule.position(21) == (1, 88, 2)
    assert schedule.position(22) == (2, 0, 2)  # 4 left, fewer than 8: dropped
    seen = epochs_read(Batches(TensorDataset(torch.arange(n))), b, schedule.segments, 30, seed=1)
    assert sorted(seen[0]) == list(range(n)) and sorted(seen[1]) == sorted(set(seen[1]))
    assert len(seen[1]) == n - 4  # every sample once, but the remainder too short for a global batch
    # Today's rule (step * k * B) jumped: grown to 3 trainers at step 7, it read epoch 0 from 84.
    assert batch_indices(n, b, 3, 0, 7, seed=1).tolist() != seen[0][28:32]


def test_the_end_step_of_epochs_follows_the_trainer_count() -> None:
    n, b = 512, 16
    for k in (1, 2, 3, 7):  # one segment: the job's own figure
        job = TrainingJob(batch_size=b, epochs=2)
        assert DataSchedule.of(n, b, [], k).end_step(2) == job.total_steps(n, k)
        assert DataSchedule.of(n, b, [], k).end_step(1.5) == job.model_copy(update={"epochs": 1.5}).total_steps(n, k)
    grown = DataSchedule.of(n, b, [], 1).resized(24, 2)  # 384 samples, then 32 a step
    assert grown.end_step(1) == 28 and grown.end_step(2) == 44 and grown.position(44) == (2, 0, 2)
    shrunk = grown.resized(40, 1)  # 12 steps into epoch 1: 384 of it seen
    assert shrunk.position(40) == (1, 384, 1) and shrunk.end_step(2) == 48
    assert shrunk.end_step(1.5) == 36  # reached in the middle segment
    assert shrunk.epochs_at(48) == 2.0


def test_resized_drops_the_segments_after_the_step_and_adds_none_for_the_same_trainer_count() -> None:
    schedule = DataSchedule.of(512, 16, [], 1).resized(24, 2).resized(40, 1)
    assert schedule.resized(50, 1) == schedule
    back = schedule.resized(32, 2)  # a rollback to 32: the shrink at 40 never happened
    assert [s.start_step for s in back.segments] == [0, 24]
    assert schedule.resized(24, 3).segments[-1] == Segment(start_step=24, trainers=3, epoch=0, offset=384)
    assert schedule.resized(8, 1).segments == [Segment(start_step=0, trainers=1)]
    with pytest.raises(ValueError):
        schedule.from_step(30).resized(20, 2)
    resumed = schedule.from_step(44)  # a resume: one segment from the restored step's position
    assert resumed.segments == [Segment(start_step=44, trainers=1, epoch=1, offset=448)]
    assert resumed.position(44) == schedule.position(44)


def test_a_resume_goes_on_from_the_position_of_the_restored_step() -> None:
    from grains.training.coordinator import _resumed_segments

    grown = DataSchedule.of(512, 16, [], 1).resized(24, 2)
    old = JobState(spec=TrainingJob(batch_size=16), trainers=2, train_size=512, committed=[32, 40],
                                 data_segments=grown.segments)  # fmt: skip
    (seg,) = _resumed_segments(old)
    assert seg == Segment(start_step=40, trainers=2, epoch=1, offset=384)  # 12 steps of 32 into epoch 1
    # Resumed with 3 trainers of 8 samples: on from sample 384 of epoch 1, 24 a step.
    again = DataSchedule.of(512, 8, [seg], 2).resized(40, 3)
    assert again.position(40) == (1, 384, 3) and again.position(41) == (1, 408, 3)


def test_state_written_under_the_old_names_loads_under_the_new_ones() -> None:
    """Coordinator state saved before the vocabulary was trainer / rank / trainers (``world`` and
    ``slots``) loads as the codec decodes it (model_validate), and is written back under the new names."""
    from grains.training.api.messages import GroupChange

    seg = Segment.model_validate({"start_step": 40, "world": 2, "epoch": 1, "offset": 384})
    assert seg == Segment(start_step=40, trainers=2, epoch=1, offset=384)
    assert seg.model_dump() == {"start_step": 40, "trainers": 2, "epoch": 1, "offset": 384}
    old = {
        "spec": {"batch_size": 16}, "status": "running", "slots": 2, "train_size": 512, "committed": [32, 40],
        "data_segments": [{"start_step": 0, "world": 1}, {"start_step": 24, "world": 2, "offset": 384}],
        "changes": [{"generation": 3, "reason": "trainer 1 restarted", "at": 1.0, "world": 2, "start_step": 40,
                     "slots": [1]}],
    }  # fmt: skip
    state = JobState.model_validate(old)
    assert state.trainers == 2 and [s.trainers for s in state.data_segments] == [1, 2]
    assert state.changes == [GroupChange(generation=3, reason="trainer 1 restarted", at=1.0, trainers=2, start_step=40,
                                         ranks=[1])]  # fmt: skip
    dumped = state.model_dump()
    assert dumped["trainers"] == 2 and "slots" not in dumped
    assert dumped["data_segments"][1] == {"start_step": 24, "trainers": 2, "epoch": 0, "offset": 384}
    assert dumped["changes"][0]["trainers"] == 2 and dumped["changes"][0]["ranks"] == [1]
    assert JobState.model_validate(dumped) == state  # the new names read back too


def test_a_coordinator_state_stored_under_its_old_class_name_loads_as_the_job_state() -> None:
    """``JobState`` was the coordinator's nested ``State``: values the codec tagged
    ``CoordinatorGrain.State`` decode as a JobState, and it writes its own name."""
    from silo.codec import Codec, TypeRegistry

    old_cls = type("State", (JobState,), {"__qualname__": "CoordinatorGrain.State", "__wire_aliases__": ()})
    before = TypeRegistry()
    before.register(old_cls)
    stored = Codec(before).encode(old_cls(trainers=2, committed=[10, 20], status="completed"))
    assert b"CoordinatorGrain.State" in stored.meta
    now = TypeRegistry()
    now.register_annotations(CoordinatorGrain)
    got = Codec(now).decode(stored.meta, stored.buffers)
    assert type(got) is JobState and (got.trainers, got.committed, got.status) == (2, [10, 20], "completed")
    assert b"JobState" in Codec(now).encode(got).meta


def test_residuals_and_job_records_written_under_the_old_names_load() -> None:
    """A trainer's saved residual (``slots``) and a dashboard record's pipeline stage (``replica``)."""
    from grains.training.api.records import JobProgress
    from grains.training.strategies.ps.trainer import ResidualSnapshot

    snap = ResidualSnapshot.model_validate({"step": 8, "slots": 3, "residual": {}})
    assert snap.trainers == 3 and "slots" not in snap.model_dump()
    raw = '{"job": "j", "stages": [{"key": "j/r1/stage-0", "replica": 1, "index": 0}]}'
    (stage,) = JobProgress.model_validate_json(raw).stages
    assert stage.rank == 1 and "replica" not in stage.model_dump()


def test_a_stream_resized_goes_on_at_the_next_item() -> None:
    n, b = 7, 2
    segments = DataSchedule.of(None, b, [], 3).resized(2, 1).resized(5, 2).segments  # 12, 3 * 2, then 4 an item
    assert DataSchedule.of(None, b, segments, 3).position(5) == (0, 18, 2)
    got: list[int] = []
    for t in range(8):
        trainers = 3 if t < 2 else 1 if t < 5 else 2
        got += [v for j in range(trainers) for v in values(Batches(Counting(n)).batch(b, trainers, j, t, 0, segments))]
    assert got == Counting(n).stream(len(got))
    with pytest.raises(ConfigError, match="needs 'steps'"):
        DataSchedule.of(None, b, segments, 3).end_step(1)


# --- end to end: a parameter-server job grown 1 -> 2 trainers, then shrunk back --------------

IDS = 512
B = 16


async def _advance(coord: Any, to: int, until: Any, timeout_s: float = 15.0) -> Any:
    """Let the trainers run up to step ``to`` and wait for ``until(status)``."""
    data_ids.control(limit=to)
    return await status_when(coord, until, timeout_s)


async def test_a_job_grown_and_shrunk_trains_every_sample_once_an_epoch(cluster, client):
    data_ids.reset(limit=20)
    try:
        await cluster(1, grains=GRAINS)
        spec = TrainingJob(
            mode="sync", trainers="auto", shards=1, epochs=2, batch_size=B, lr=0.05, checkpoint_every=8,
            keep_checkpoints=20, model_args={"in_features": 8, "hidden": [16], "classes": 2},
            dataset="tests.grains.training.data_ids:ids", dataset_args={"size": IDS},
            step="tests.grains.training.data_ids:step",
        )  # fmt: skip
        coord = client.get_grain(CoordinatorGrain, "ids-grow-shrink")
        await coord.start(spec)
        first = await status_when(coord, lambda s: s.status == "running" and 16 in s.checkpoints)
        assert first.trainers == 1 and first.total_steps == 2 * IDS // B
        await cluster(1, grains=GRAINS)
        await training_silos(client, 2)
        # The next committed checkpoint takes the joined silo in: 24, else 32.
        grown = await grown_at_a_gate(coord, lambda s: s.trainers == 2, 24, 32, 8)
        c = grown.changes[-1].start_step
        assert c in (24, 32) and grown.total_steps == DataSchedule.of(IDS, B, [], 1).resized(c, 2).end_step(2)
        # Shrink after one more checkpoint of two trainers: one of them runs out of memory.
        await _advance(coord, c + 12, lambda s: c + 8 in s.checkpoints)
        data_ids.control(oom_at=c + 12, oom_gen=grown.generation)
        shrunk = await _advance(coord, c + 16, lambda s: s.trainers == 1 and s.generation > grown.generation)
        assert shrunk.changes[-1].start_step == c + 8, shrunk.changes
        data_ids.control(limit=None)
        st = await wait_done(coord, 60.0)
    finally:
        data_ids.control(limit=None, oom_at=None)
    assert st.status == "completed" and st.trainers == 1, st
    schedule = DataSchedule.of(IDS, B, [], 1)
    for change in st.changes:
        schedule = schedule.resized(change.start_step, change.trainers)
    assert [(seg.start_step, seg.trainers) for seg in schedule.segments] == [(0, 1), (c, 2), (c + 8, 1)]
    assert st.total_steps == schedule.end_step(2) and (st.data_epoch, st.data_offset) == (2, 0), st
    counted = data_ids.last_attempts(data_ids.RECORDS)
    assert max(t for t, _ in counted) == st.total_steps - 1
    times = Counter(i for batch in counted.values() for i in batch)
    assert set(times) == set(range(IDS)) and set(times.values()) == {2}, Counter(times.values())


def test_the_end_to_end_helper_counts_only_the_last_attempt_of_each_step() -> None:
    records = [(1, 0, 0, [1]), (1, 0, 1, [2]), (1, 0, 2, [3]), (2, 0, 1, [4]), (2, 1, 1, [5]), (2, 0, 2, [6])]
    assert data_ids.last_attempts(records) == {(0, 0): [1], (1, 0): [4], (1, 1): [5], (2, 0): [6]}
