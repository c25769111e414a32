"""Batches from any dataset: collation, the batch schedule, streams and loader workers.

The batch schedule is the contract that makes sync mode equal to plain
training. Where a step's samples begin is the job's data position, counted in
samples (:mod:`grains.training.data.position`: segments of constant trainer
count ``k``, which the coordinator extends whenever ``k`` changes, so a
resize continues from the next unseen sample).

*Map-style*: epoch ``e`` shuffles the training set with ``torch.randperm(n,
generator=seed + e)``; each global step takes the next ``k * B`` samples of
the current epoch's permutation, and trainer ``j`` (its rank) gets the ``j``-th
``B`` of them. When fewer than ``k * B`` remain, the rest of the epoch is
dropped and the step starts epoch ``e + 1`` at offset 0. With ``k`` constant
from step 0 this is: step ``t`` (epoch ``t // S``, ``S = n // (k * B)``)
takes ``[(t % S) * k * B, (t % S + 1) * k * B)`` of the permutation.

*IterableDataset*: its passes, concatenated, are one endless stream (pass
``e`` is ``iter(ds)`` after ``ds.set_epoch(e)`` where the dataset has that
method; otherwise every pass must yield the same items in the same order).
Nothing is dropped and nothing is shuffled: the position is a plain offset in
the stream, each global step takes its next ``k * B`` items (with ``k``
constant: ``[t * k * B, (t + 1) * k * B)``), so a global batch may span
the end of one pass and the start of the next, and trainer ``j`` gets the
``j``-th ``B`` of them. Every trainer reads the whole stream and keeps its
share: with k trainers each item is produced k times, the price of not asking
the dataset to shard itself. Steps read in order cost only their own items.
A fresh reader (a trainer restarted at step ``t`` from a checkpoint) produces
and throws away the items before its first batch, once, and
then reads exactly what an uninterrupted run reads; a step before the
reader's position starts again at the beginning of the pass that holds it
(where passes begin is learnt by reading them through, and a pass whose
length changes is a ConfigError). Evaluation reads one pass, ``iter(ds)``.

``loader_workers > 0`` loads map-style batches in DataLoader worker processes
(from a forkserver: a clean process that forks them, started once per silo;
forking the silo itself copied its event loop and threads) with the
same index lists, so the batches equal those of ``workers=0``. A tensor
dataset keeps its fast path (one gather needs no workers). An IterableDataset
cannot be split among workers without its help (each would yield the whole
stream), so workers with one are refused.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from grains.training.api.job import TrainingJob, resolve_path
from grains.training.data.position import DataSchedule, Segment
from grains.training.datasets import dataset_size, load_dataset
from silo.errors import ConfigError


def to_device(batch: Any, device: str | torch.device) -> Any:
    """``batch`` with every tensor in it (any nesting of tuple, list, dict, namedtuple) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        return moved if type(batch) is dict else _same_type(batch, moved)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        items = [to_device(v, device) for v in batch]
        if type(batch) is list:
            return items
        return tuple(items) if type(batch) is tuple else _same_type(batch, items)
    return batch


def _same_type(like: Any, value: Any) -> Any:
    """``value`` as ``like``'s container type, or as it is when that type cannot be built from it."""
    try:
        return type(like)(value)
    except TypeError:
        return value


def batch_samples(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor of at least one dimension.

    Depth first, dicts in insertion order; a 0-d tensor (a scalar beside the
    data) has no leading size and is passed over.
    """
    leaf = _first_tensor(batch)
    if leaf is None:
        raise ConfigError(f"a batch of {type(batch).__name__} holds no tensor to count its samples by")
    return int(leaf.shape[0])


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch if batch.dim() > 0 else None
    children: Iterable[Any]
    if isinstance(batch, Mapping):
        children = batch.values()
    elif isinstance(batch, (list, tuple)):
        children = batch
    else:
        return None
    for child in children:
        leaf = _first_tensor(child)
        if leaf is not None:
            return leaf
    return None


def collate(items: Sequence[Any]) -> Any:
    """``default_collate(items)``, except that tuples stay tuples (torch makes them lists).

    So ``(input, label)`` items give an ``(x, y)`` tuple, the same value as
    the tensor fast path; items that do not stack are a ConfigError.
    """
    if not items:
        raise ConfigError("cannot collate a batch of no items")
    try:
        out = default_collate(list(items))
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"dataset items do not collate into a batch: {exc}") from None
    return _retuple(items[0], out)


class _user_collate:
    """A job's ``collate_fn`` (``pkg.module:fn``, items -> batch), its failures a ConfigError."""

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        self.fn = fn

    def __call__(self, items: Sequence[Any]) -> Any:
        if not items:
            raise ConfigError("cannot collate a batch of no items")
        try:
            return self.fn(list(items))
        except Exception as exc:
            raise ConfigError(f"the collate_fn raised {type(exc).__name__}: {exc}") from exc


def _retuple(elem: Any, out: Any) -> Any:
    if isinstance(elem, torch.Tensor):
        return out
    if isinstance(elem, Mapping) and isinstance(out, Mapping):
        fixed = {k: _retuple(elem[k], out[k]) for k in out}
        return fixed if type(out) is dict else _same_type(out, fixed)
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):
        return type(out)(*(_retuple(e, o) for e, o in zip(elem, out, strict=True)))
    if isinstance(elem, (tuple, list)) and isinstance(out, list) and len(elem) == len(out):
        fixed_items = [_retuple(e, o) for e, o in zip(elem, out, strict=True)]
        return tuple(fixed_items) if isinstance(elem, tuple) else fixed_items
    return out


def steps_per_epoch(n: int, batch_size: int, trainers: int) -> int:
    return max(1, n // (batch_size * trainers))


def batch_indices(n: int, batch_size: int, trainers: int, rank: int, step: int, seed: int) -> torch.Tensor:
    """Indices of trainer ``rank``'s batch at global ``step`` with ``trainers`` trainers from step 0
    (the closed form of the module docstring's rule; :meth:`Batches.indices` takes any schedule)."""
    per_epoch = steps_per_epoch(n, batch_size, trainers)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    start = (i * trainers + rank) * batch_size
    return perm[start : start + batch_size]


class _Stream:
    """An IterableDataset's passes read as one endless stream, keeping its place.

    Remembers where each pass it has read to the end began, so going back
    starts over at the pass holding the position rather than at the very start.
    """

    def __init__(self, ds: IterableDataset[Any]) -> None:
        self._ds = ds
        self._starts = [0]  # stream position where pass e begins, for every pass begun
        self._it: Iterator[Any] | None = None
        self._epoch = 0
        self._pos = 0  # stream position of the item self._it yields next

    def read(self, start: int, stop: int) -> list[Any]:
        """The stream's items ``[start, stop)``."""
        if self._it is None or start < self._pos:
            self._open(bisect.bisect_right(self._starts, start) - 1)
        items: list[Any] = []
        while self._pos < stop:
            item = self._next()
            if self._pos > start:
                items.append(item)
        return items

    def _open(self, epoch: int) -> None:
        set_epoch = getattr(self._ds, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self._it = iter(self._ds)
        self._epoch = epoch
        self._pos = self._starts[epoch]

    def _next(self) -> Any:
        while True:
            assert self._it is not None
            try:
                item = next(self._it)
            except StopIteration:
                if self._pos == self._starts[self._epoch]:
                    raise ConfigError(
                        f"{type(self._ds).__name__} yielded no items in pass {self._epoch}"
                    ) from None
                if len(self._starts) == self._epoch + 1:
                    self._starts.append(self._pos)
                elif self._starts[self._epoch + 1] != self._pos:
                    raise ConfigError(
                        f"{type(self._ds).__name__} yielded {self._pos - self._starts[self._epoch]} items in "
                        f"pass {self._epoch}, not the {self._starts[self._epoch + 1] - self._starts[self._epoch]} "
                        "of its first reading: its passes must be deterministic"
                    )
                self._open(self._epoch + 1)
                continue
            self._pos += 1
            return item


class _StepIndices:
    """The index lists of one rank's steps, a DataLoader ``batch_sampler``."""

    def __init__(
        self, batches: Batches, batch_size: int, trainers: int, rank: int, steps: range, seed: int,
        segments: Sequence[Segment] | None,
    ) -> None:  # fmt: skip
        self._batches, self._steps = batches, steps
        self._args = (batch_size, trainers, rank, seed, segments)

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[list[int]]:
        b, k, j, seed, segments = self._args
        for step in self._steps:
            yield self._batches.indices(b, k, j, step, seed, segments).tolist()


class Batches:
    """The batches of one dataset split by the schedule in the module docstring.

    ``segments`` (:class:`~grains.training.data.position.Segment`, the job's data position)
    say where each step's samples begin; None or empty: ``trainers`` trainers from step 0.
    Map-style: keeps the current epoch's permutation, so a step costs one
    gather (tensor datasets) or one collate of its items. IterableDataset:
    keeps its place in the stream, so steps read in order cost only their
    items. Used from one thread at a time.
    """

    def __init__(
        self, ds: Dataset[Any], device: str | torch.device = "cpu", workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:  # fmt: skip
        if workers < 0:
            raise ConfigError(f"loader workers must be >= 0, not {workers}")
        self._ds = ds
        self._collate: Callable[[Sequence[Any]], Any] = collate if collate_fn is None else _user_collate(collate_fn)
        self._device = device
        self._workers = workers
        self._size = dataset_size(ds)
        self._stream: _Stream | None = None
        self._tensors: tuple[torch.Tensor, ...] | None = None
        if isinstance(ds, IterableDataset):
            if workers:
                raise ConfigError(
                    f"loader_workers={workers} with an IterableDataset ({type(ds).__name__}): each worker "
                    "would yield the whole stream; use loader_workers=0 or a map-style dataset"
                )
            self._stream = _Stream(ds)
        else:
            tensors = getattr(ds, "tensors", None)
            if collate_fn is None and isinstance(tensors, tuple) and tensors and all(isinstance(t, torch.Tensor) for t in tensors):
                self._tensors = tuple(t.to(device) for t in tensors)
        self._perm_key: tuple[int, int] | None = None
        self._perm: torch.Tensor | None = None
        self._schedule_key: tuple[int, int, tuple[Segment, ...]] | None = None
        self._schedule: DataSchedule | None = None
        self._schedule_args: tuple[int, int, int] | None = None
        self._schedule_of: Sequence[Segment] | None = None

    @property
    def size(self) -> int | None:
        """Samples in the split; None for an IterableDataset without a length."""
        return self._size

    def __len__(self) -> int:
        if self._size is None:
            raise TypeError(f"{type(self._ds).__name__} has no length")
        return self._size

    def schedule(self, batch_size: int, trainers: int, segments: Sequence[Segment] | None = None) -> DataSchedule:
        """The data position of this split's steps (kept while the arguments stay the same)."""
        # Asked once a step with the same arguments (the same list of segments): an identity check
        # first, since comparing the segments' models cost more than the plain loop's batch arithmetic.
        args = (batch_size, trainers, len(segments or ()))
        if self._schedule is not None and self._schedule_args == args and segments is self._schedule_of:
            return self._schedule
        key = (batch_size, trainers, tuple(segments or ()))
        if self._schedule is None or self._schedule_key != key:
            self._schedule = DataSchedule.of(self._size, batch_size, key[2], trainers)
            self._schedule_key = key
        self._schedule_args, self._schedule_of = args, segments
        return self._schedule

    def _start(self, batch_size: int, trainers: int, rank: int, step: int, segments: Sequence[Segment] | None) -> tuple[int, int]:
        """``(epoch, first sample)`` of ``rank``'s batch at ``step``."""
        epoch, offset, taking = self.schedule(batch_size, trainers, segments).position(step)
        if not 0 <= rank < taking:
            raise ValueError(f"rank {rank} of a step that {taking} trainer(s) take (step {step})")
        return epoch, offset + rank * batch_size

    def indices(
        self, batch_size: int, trainers: int, rank: int, step: int, seed: int, segments: Sequence[Segment] | None = None
    ) -> torch.Tensor:
        """Map-style: the dataset indices of ``rank``'s batch at ``step`` (one segment: = :func:`batch_indices`)."""
        n = self._map_size()
        epoch, start = self._start(batch_size, trainers, rank, step, segments)
        if self._perm_key != (seed, epoch):
            self._perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
            self._perm_key = (seed, epoch)
        assert self._perm is not None
        return self._perm[start : start + batch_size]

    def batch(
        self, batch_size: int, trainers: int, rank: int, step: int, seed: int, segments: Sequence[Segment] | None = None
    ) -> Any:
        """Trainer ``rank``'s batch (of ``trainers``) at global ``step``, on the device."""
        if self._stream is not None:
            _, start = self._start(batch_size, trainers, rank, step, segments)
            return to_device(self._collate(self._stream.read(start, start + batch_size)), self._device)
        return self.gather(self.indices(batch_size, trainers, rank, step, seed, segments))

    def iterate(
        self, batch_size: int, trainers: int, rank: int, start_step: int, end_step: int, seed: int,
        segments: Sequence[Segment] | None = None,
    ) -> Iterator[Any]:  # fmt: skip
        """The batches of steps ``start_step .. end_step - 1`` in order (in workers when configured).

        With workers, close the iterator (or drop it) to stop them early.
        """
        if self._workers == 0 or self._tensors is not None or self._stream is not None:
            for step in range(start_step, end_step):
                yield self.batch(batch_size, trainers, rank, step, seed, segments)
            return
        sampler = _StepIndices(self, batch_size, trainers, rank, range(start_step, end_step), seed, segments)
        yield from self._load(sampler)

    def eval_batches(self, batch_size: int) -> Iterator[Any]:
        """The whole split in order, in batches of ``batch_size`` (the last one partial), on the device."""
        if self._stream is not None:
            chunk: list[Any] = []
            seen = 0
            for item in self._ds:  # type: ignore[attr-defined]
                chunk.append(item)
                seen += 1
                if len(chunk) == batch_size:
                    yield to_device(self._collate(chunk), self._device)
                    chunk = []
            if chunk:
                yield to_device(self._collate(chunk), self._device)
            if not seen:
                raise ConfigError(f"{type(self._ds).__name__} yielded no items to evaluate on")
            return
        n = self._map_size()
        if self._tensors is not None:
            for s in range(0, n, batch_size):
                yield tuple(t[s : s + batch_size] for t in self._tensors)
            return
        chunks = [list(range(s, min(s + batch_size, n))) for s in range(0, n, batch_size)]
        if self._workers:
            yield from self._load(chunks)
        else:
            for idx in chunks:
                yield to_device(self._collate([self._ds[i] for i in idx]), self._device)

    def gather(self, idx: torch.Tensor) -> Any:
        """Map-style: the batch of the items at ``idx``, on the device."""
        if self._tensors is not None:
            i = idx.to(self._tensors[0].device)
            return tuple(t[i] for t in self._tensors)
        return to_device(self._collate([self._ds[i] for i in idx.tolist()]), self._device)

    def all(self, limit: int | None = None) -> Any:
        """The first ``limit`` samples (all when None) as one batch."""
        if self._stream is None:
            n = self._map_size()
            return self.gather(torch.arange(n if limit is None else min(limit, n)))
        items: list[Any] = []
        for item in self._ds:  # type: ignore[attr-defined]
            if limit is not None and len(items) >= limit:
                break
            items.append(item)
        return to_device(self._collate(items), self._device)

    def _map_size(self) -> int:
        if self._size is None:
            raise ConfigError(f"{type(self._ds).__name__} is a stream: it has no indices")
        return self._size

    def _load(self, batch_sampler: Iterable[list[int]]) -> Iterator[Any]:
        loader = DataLoader(
            self._ds,
            batch_sampler=batch_sampler,
            num_workers=self._workers,
            collate_fn=self._collate,
            pin_memory=str(self._device).startswith("cuda"),
            # Not forked from the silo: a fork of a process with an event loop and thread pools
            # inherits their state, and its workers died at shutdown (exit code 1). A forkserver
            # is a clean single-threaded process that forks the workers; it starts once per silo.
            multiprocessing_context="forkserver",
            persistent_workers=False,
        )
        it = iter(loader)
        try:
            for b in it:
                yield to_device(b, self._device)
        finally:
            # Stop the worker processes now, from the thread that closes this generator, rather
            # than whenever the iterator is collected (its __del__ may then find them gone).
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()


def collate_function(spec: TrainingJob) -> Callable[[list[Any]], Any] | None:
    """The job's ``collate_fn`` resolved (None: :func:`collate`)."""
    return None if spec.collate_fn is None else resolve_path(spec.collate_fn, "collate_fn")  # type: ignore[no-any-return]


def job_batches(spec: TrainingJob, split: str, device: str | torch.device = "cpu", workers: int = 0) -> Batches:
    """Split ``split`` of the job's dataset as :class:`Batches`, collated by the job's ``collate_fn``."""
    return Batches(load_dataset(spec, split), device, workers, collate_function(spec))
