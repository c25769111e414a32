"""Checkpoint storage for parameter shards, on the silo's snapshot API (silo/storage/checkpoint.py).

A part holds its trainable parameters with their optimizer state, and its
frozen parameters and persistent buffers (``buffers``), all by parameter name,
never by a layout's position (:mod:`grains.training.state.optimizer_state`).
Its optimizer's parameter groups carry their spec index as ``rg_group``
(:mod:`grains.training.loop.optim`), so :func:`extract` can cut the state of any
set of parameters out of parts of any layout and regroup it as the new
holder's optimizer builds its groups.

Every shard of a job saves its part of snapshot ``(training.{job}.r{run}, step)``
with the same member list, under its generation (the store's ``epoch``: a later
generation takes over what an abandoned one left at the same step), so the snapshot becomes complete (and listed)
only when all shards have saved that step; the store keeps the newest
``keep_checkpoints`` complete ones. The coordinator tracks the same thing
from the shards' reports and restores only complete steps.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from grains.base import Grain
from grains.checkpoints import snapshots
from grains.training.api.job import TrainingJob
from grains.training.loop.optim import DEFAULT_GROUP, group_order, trainable
from grains.training.state.model_tensors import frozen_parameters, persistent_buffers
from grains.training.state.optimizer_state import named_state
from silo import errors


def checkpoint_due(spec: TrainingJob, step: int, end_step: int) -> bool:
    """Whether every holder snapshots the state after ``step`` global steps: the one rule of every
    mode. Each multiple of ``checkpoint_every``, each of ``eval_every`` (mid-run evaluation reads a
    committed step, never weights torn between steps) and the job's last step."""
    if step <= 0:
        return False
    every, evals = spec.checkpoint_every, spec.eval_every
    return step == end_step or bool(every and step % every == 0) or bool(evals and step % evals == 0)


def next_checkpoint(spec: TrainingJob, step: int, end_step: int) -> int:
    """The first step after ``step`` that :func:`checkpoint_due` names (0: none)."""
    after = [(step // n + 1) * n for n in (spec.checkpoint_every, spec.eval_every) if n]
    if end_step > step:
        after.append(end_step)
    after = [c for c in after if c <= end_step] if end_step > step else after
    return min(after, default=0)


def retained(spec: TrainingJob) -> int:
    """How many complete checkpoints the store itself keeps of a run (its retention, applied as
    each save completes one). ``keep_checkpoints``; with mid-run evaluation, no limit it would
    reach: the coordinator prunes instead, once a checkpoint is evaluated, since the store
    dropped checkpoints due for evaluation before the coordinator could read them."""
    return spec.keep_checkpoints if not spec.eval_every else spec.keep_checkpoints + _EVALUATION_SLACK


_EVALUATION_SLACK = 1_000_000


class TrainingSnapshot(BaseModel):
    """One holder's part of a checkpoint, the one format of every mode (a PS shard's slice, an
    all-reduce rank's whole model, a pipeline stage's layers): fp32 parameters with their
    optimizer state, buffers, the schedule's position and the loss scaler."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    __wire_aliases__: ClassVar[tuple[str, ...]] = ("ShardSnapshot",)
    """Checkpoints written before the rename (the codec tags values with class names)."""

    step: int
    """Global steps applied: the one meaning of a step number in every mode (a holder restored
    from it continues at this step, with its own mode's rule)."""
    version: int
    """Equal to ``step`` (older checkpoints of async shards hold their push count: restores ignore it)."""
    params: dict[str, torch.Tensor]
    """In model order (the optimizer state is indexed by it)."""
    optimizer: dict[str, Any]
    """The holder's optimizer state by parameter name (:func:`~grains.training.state.optimizer_state.optimizer_state`;
    {}: none yet, e.g. ``init_from``; checkpoints of before hold ``state_dict()``'s positions)."""
    buffers: dict[str, torch.Tensor] = Field(default_factory=dict)
    """Frozen parameters and persistent buffers (BatchNorm statistics) this part holds."""
    scaler: dict[str, float] = Field(default_factory=dict)
    """The fp16 loss scaler of a holder that steps the optimizer (:class:`~grains.training.loop.loss_scale.LossScaler`;
    {}: none, or a mode whose trainers keep their own)."""


class SnapshotState(BaseModel):
    """A shard's state: empty, except while a snapshot is being saved or loaded."""

    snapshot: TrainingSnapshot | None = None


def initial(model: nn.Module, optimizer: dict[str, Any] | None = None) -> TrainingSnapshot:
    """``model``'s weights as step 0 of a run, with ``optimizer`` state (default none yet): the
    seeded model, or ``init_from``'s, saved whole so every holder restores its part from a
    checkpoint and builds only that part."""

    def cpu(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype, copy=True)

    buffers = {n: cpu(p) for n, p in frozen_parameters(model)}
    buffers.update({n: cpu(b) for n, b in persistent_buffers(model)})
    params = {n: cpu(p) for n, p in trainable(model)}
    return TrainingSnapshot(step=0, version=0, params=params, optimizer=optimizer or {}, buffers=buffers)


def group(job: str, run: int) -> str:
    return f"training.{job}.r{run}"


def best_group(job: str, run: int) -> str:
    """The group of the one checkpoint ``keep_best`` keeps, apart from retention's."""
    return f"{group(job, run)}.best"


def member(key: str, type_name: str = "ParamShardGrain") -> str:
    """The snapshot member id of a job's part-holder (a parameter shard, or a pipeline stage)."""
    return f"{type_name}/{key}"


async def save(
    shard: Grain, job: str, run: int, snapshot: TrainingSnapshot, shard_keys: list[str], keep: int,
    generation: int | None = None,
) -> bool:  # fmt: skip
    """Save this shard's part of the job's snapshot at ``snapshot.step``; True if it completed it.

    ``generation`` owns the snapshot (the store's epoch): what a rolled-back generation left at
    this step, complete or not, is taken over rather than blocking the save or mixing with it."""
    shard.state.snapshot = snapshot
    try:
        # A save encodes the state before its first await, so saves of
        # two steps may overlap safely.
        members = [member(k, type(shard).__name__) for k in shard_keys]
        return await snapshots(shard).save(group(job, run), snapshot.step, members, keep=keep, epoch=generation)
    finally:
        shard.state.snapshot = None


async def save_whole(
    grain: Grain, job: str, run: int, snapshot: TrainingSnapshot, keep: int, generation: int | None = None
) -> bool:
    """Save the whole model as the only member of the job's snapshot (all-reduce mode's rank 0)."""
    grain.state.snapshot = snapshot
    try:
        return await snapshots(grain).save(group(job, run), snapshot.step, keep=keep, epoch=generation)
    finally:
        grain.state.snapshot = None


async def load_model(
    grain: Grain, job: str, run: int, step: int, names: list[str], extra: list[str] | None = None, name: str | None = None
) -> TrainingSnapshot:
    """Parameters ``names`` (trainable, model order) with their optimizer state, and the frozen
    parameters and buffers ``extra``, at ``step``, from every member of the snapshot, whichever
    mode saved it (shards of any layout, or one all-reduce trainer or the job's init weights).

    ``grain`` must keep its state as :class:`SnapshotState` (its codec decodes the members).
    """
    g = name or group(job, run)
    checkpoints = snapshots(grain)
    info = await checkpoints.info(g, step)
    if info is None or not info.complete:
        raise errors.StorageError(f"snapshot {g}/{step} is missing or incomplete")
    parts = []
    for m in info.members:
        decoded = await checkpoints.read_member(g, step, m)
        if decoded.snapshot is None:
            raise errors.StorageError(f"snapshot {g}/{step} member {m} holds no model data")
        parts.append(decoded.snapshot)
    return extract(parts, names, extra or [])


def extract(parts: list[TrainingSnapshot], names: list[str], extra: list[str] | None = None) -> TrainingSnapshot:
    """The snapshot an owner of ``names`` (trainable, model order) and ``extra`` (frozen
    parameters, buffers) restores, cut from snapshots of any parts.

    The optimizer state is by name (:mod:`grains.training.state.optimizer_state`): each
    parameter's state, and its group's settings with the group's members among ``names``, in
    groups ordered as :func:`grains.training.loop.optim.build_optimizer` builds them.
    """
    where: dict[str, TrainingSnapshot] = {}
    held: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {}
    settings: dict[int, dict[str, Any]] = {}
    tag_of: dict[str, int] = {}
    for part in parts:
        for name in part.params:
            where[name] = part
            held[name] = part.params[name]
        held.update(part.buffers)
        saved = named_state(part.optimizer, list(part.params))
        state.update(saved.get("state", {}))
        for g in saved.get("param_groups", []):
            tag = int(g.get("rg_group", DEFAULT_GROUP))
            settings.setdefault(tag, {k: v for k, v in g.items() if k != "params"})
            tag_of.update(dict.fromkeys(g["params"], tag))
    missing = [n for n in names if n not in where] + [n for n in extra or [] if n not in held]
    if missing:
        raise errors.StorageError(f"checkpoint lacks tensors {missing[:5]}")
    members: dict[int, list[str]] = {}
    for name in names:
        if name in tag_of:
            members.setdefault(tag_of[name], []).append(name)
    groups = [{**settings[t], "params": members[t]} for t in sorted(members, key=group_order)]
    return TrainingSnapshot(
        step=parts[0].step,
        version=max(p.version for p in parts),
        params={n: where[n].params[n] for n in names},
        optimizer={"state": {n: state[n] for n in names if n in state}, "param_groups": groups} if groups else {},
        buffers={n: held[n] for n in extra or []},
        scaler=next((p.scaler for p in parts if p.scaler), {}),
    )


def covers(snap: TrainingSnapshot, names: list[str], extra: list[str]) -> bool:
    """Whether ``snap`` is exactly the part an owner of ``names`` and ``extra`` restores (the
    same layout saved it), so it needs no cut."""
    return list(snap.params) == names and set(extra) <= set(snap.buffers)


async def load(
    shard: Grain, job: str, run: int, step: int, names: list[str] | None = None, extra: list[str] | None = None
) -> TrainingSnapshot:
    """This shard's part of snapshot ``step``; with ``names`` (and ``extra``), also from a snapshot
    saved in another layout (other shards, all-reduce mode's whole model, init weights): a job
    may switch modes."""
    if names is not None:
        info = await snapshots(shard).info(group(job, run), step)
        if info is not None and member(shard.key, type(shard).__name__) not in info.members:
            return await load_model(shard, job, run, step, names, extra)
    await snapshots(shard).load(group(job, run), step, write=False)
    snap, shard.state.snapshot = shard.state.snapshot, None
    if snap is None:
        raise errors.StorageError(f"snapshot {group(job, run)}/{step} holds no shard data for {shard.key}")
    if names is not None and not covers(snap, names, extra or []):
        # A member of the same key in another layout (shard 0 of two, restored as the one
        # shard): its part is not this holder's; cut this holder's out of every member.
        return await load_model(shard, job, run, step, names, extra)
    return snap  # type: ignore[no-any-return]


async def exists(grain: Grain, job: str, run: int, step: int) -> bool:
    """Whether checkpoint ``step`` of a run is complete in the store."""
    info = await snapshots(grain).info(group(job, run), step)
    return info is not None and info.complete


async def newest_step(grain: Grain, job: str, run: int) -> int | None:
    """The newest complete checkpoint of a run, as the store knows it (None: none yet).

    The store is the truth: a coordinator's own list may lag behind it (shards can
    complete several checkpoints between two of its ticks, and retention may already
    have dropped the one it knows as newest).
    """
    latest = await snapshots(grain).latest_complete(group(job, run))
    return int(latest.snapshot_id) if latest is not None else None


async def drop_after(grain: Grain, job: str, run: int, step: int | None) -> int:
    """Delete a run's checkpoints newer than ``step`` (complete or not); how many.

    A rollback to ``step`` abandons everything trained after it: shards will save
    those step numbers again, and an old complete snapshot under the same id must not
    be mistaken for (or mixed with) the new one.
    """
    g, checkpoints = group(job, run), snapshots(grain)
    dropped = 0
    for info in [*await checkpoints.list(g), *await checkpoints.list(g, pending=True)]:
        if step is None or int(info.snapshot_id) > step:
            dropped += bool(await checkpoints.delete(g, info.snapshot_id))
    return dropped
