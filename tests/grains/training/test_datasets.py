"""The data layer: batches of any nesting, both dataset kinds, one schedule for all of them."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from grains.training.api.job import TrainingJob
from grains.training.data.batches import Batches, batch_indices, batch_samples, collate, to_device
from grains.training.datasets import dataset_size, load_dataset, regression, tokens, tokens_stream
from grains.training.models import cnn_bn, regressor, tiny_lm
from silo.errors import ConfigError

Pair = namedtuple("Pair", "x y")


class Items(Dataset[Any]):
    """A map-style dataset without ``.tensors``: the generic, item-by-item path."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        return self.ds[i]


class Counting(IterableDataset[torch.Tensor]):
    """Yields tensor(i) for i < n; with ``shift``, pass e yields (i + e * shift) % n (a set_epoch user)."""

    def __init__(self, n: int, shift: int = 0) -> None:
        self.n, self.shift, self.epoch = n, shift, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        offset = self.epoch * self.shift
        return (torch.tensor((i + offset) % self.n) for i in range(self.n))

    def stream(self, length: int) -> list[int]:
        """What the concatenated passes hold: the reference the schedule is checked against."""
        return [(p % self.n + (p // self.n) * self.shift) % self.n for p in range(length)]


def numbers(split: str = "train", n: int = 10) -> Dataset[Any]:
    return TensorDataset(torch.arange(n))


def not_a_dataset(split: str = "train") -> Any:
    return (i for i in range(3))


def stream_factory(split: str = "train") -> Any:
    return Counting(5)


def values(batch: torch.Tensor) -> list[int]:
    return [int(v) for v in batch]


def flat(parts: Any) -> list[int]:
    return [v for part in parts for v in part]


def test_load_dataset_takes_map_style_and_iterable_and_names_anything_else() -> None:
    here = "tests.grains.training.test_datasets"
    assert len(load_dataset(TrainingJob(dataset=f"{here}:numbers"), "train")) == 10  # type: ignore[arg-type]
    assert isinstance(load_dataset(TrainingJob(dataset=f"{here}:stream_factory"), "train"), Counting)
    with pytest.raises(ConfigError, match="generator"):
        load_dataset(TrainingJob(dataset=f"{here}:not_a_dataset"), "train")
    with pytest.raises(ConfigError, match="empty"):
        load_dataset(TrainingJob(dataset=f"{here}:numbers", dataset_args={"n": 0}), "train")


def test_dataset_size_is_none_only_for_a_stream_without_length() -> None:
    assert dataset_size(regression(samples=100)) == 100
    assert dataset_size(tokens(sequences=7)) == 7
    assert dataset_size(tokens_stream(sequences=7)) is None
    assert Batches(tokens_stream(sequences=7)).size is None


def test_fast_path_equals_the_generic_path_for_any_number_of_tensors() -> None:
    g = torch.Generator().manual_seed(1)
    x, y, w = torch.randn(50, 3, generator=g), torch.randint(0, 4, (50,), generator=g), torch.rand(50, generator=g)
    for ds in (TensorDataset(x, y), TensorDataset(x, y, w), TensorDataset(x)):
        fast, generic = Batches(ds), Batches(Items(ds))
        for step in (0, 3, 7):  # 7 is in the second epoch
            a, b = fast.batch(8, 2, 1, step, seed=5), generic.batch(8, 2, 1, step, seed=5)
            assert type(a) is tuple and type(b) is tuple and len(a) == len(b) == len(ds.tensors)
            for ta, tb in zip(a, b, strict=True):
                assert ta.dtype == tb.dtype and torch.equal(ta, tb)


def test_dict_items_give_dict_batches() -> None:
    batch = Batches(tokens(sequences=40, length=6)).batch(4, 2, 0, 0, seed=0)
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 6)
    assert batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])  # next-token targets


def test_collate_keeps_tuples_namedtuples_and_dicts_and_makes_ints_tensors() -> None:
    x, y = collate([(torch.zeros(2), 1), (torch.ones(2), 2)])
    assert torch.equal(x, torch.tensor([[0.0, 0.0], [1.0, 1.0]])) and torch.equal(y, torch.tensor([1, 2]))
    nested = collate([{"a": (torch.zeros(1), 3), "p": Pair(1, 2)}, {"a": (torch.ones(1), 4), "p": Pair(5, 6)}])
    assert type(nested["a"]) is tuple and torch.equal(nested["a"][1], torch.tensor([3, 4]))
    assert type(nested["p"]) is Pair and torch.equal(nested["p"].y, torch.tensor([2, 6]))
    with pytest.raises(ConfigError, match="collate"):
        collate([torch.zeros(2), torch.zeros(3)])


def test_map_style_batch_is_the_items_at_batch_indices() -> None:
    ds = Items(TensorDataset(torch.arange(23) * 10))
    batches = Batches(ds)
    for step in range(6):  # 23 // (3 * 2) = 3 steps per epoch: two epochs
        idx = batch_indices(23, 3, 2, 1, step, seed=9)
        assert values(batches.batch(3, 2, 1, step, seed=9)[0]) == [10 * int(i) for i in idx]


def test_ranks_partition_each_global_batch() -> None:
    n, b, k, seed = 40, 4, 3, 2
    ranks = [Batches(TensorDataset(torch.arange(n))) for _ in range(k)]
    for step in range(6):
        epoch, i = divmod(step, n // (b * k))
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        parts = [values(ranks[j].batch(b, k, j, step, seed)[0]) for j in range(k)]
        assert flat(parts) == values(perm[i * b * k : (i + 1) * b * k])
        assert len(set(flat(parts))) == b * k  # disjoint


def test_iterable_ranks_split_the_stream_and_continue_across_passes() -> None:
    n, b, k = 7, 2, 3  # 6 items per global batch: global batches span passes
    readers = [Batches(Counting(n)) for _ in range(k)]
    got: list[int] = []
    for step in range(5):
        got += flat(values(readers[j].batch(b, k, j, step, seed=0)) for j in range(k))
    assert got == Counting(n).stream(5 * b * k)


def test_iterable_started_at_step_t_reads_what_an_uninterrupted_run_reads() -> None:
    n, b, k, j = 9, 2, 2, 1
    ds = Counting(n, shift=4)  # each pass in another order: set_epoch must be honoured
    whole = [values(x) for x in Batches(ds).iterate(b, k, j, 0, 12, seed=0)]
    stream = ds.stream(12 * b * k)
    assert whole == [stream[(t * k + j) * b : (t * k + j + 1) * b] for t in range(12)]
    for t in (0, 3, 8):
        assert values(Batches(Counting(n, shift=4)).batch(b, k, j, t, seed=0)) == whole[t]
    back = Batches(Counting(n, shift=4))
    for t in (10, 2, 11, 5, 5):  # going back starts again at the pass that holds the step
        assert values(back.batch(b, k, j, t, seed=0)) == whole[t]


def test_iterable_with_an_empty_pass_fails_clearly() -> None:
    with pytest.raises(ConfigError, match="no items"):
        Batches(Counting(0)).batch(2, 1, 0, 0, seed=0)


class Shrinking(IterableDataset[torch.Tensor]):
    """Three items in its first pass, two in every later one: not a deterministic stream."""

    def __init__(self) -> None:
        self.passes = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.passes += 1
        return iter(torch.arange(3 if self.passes == 1 else 2))


def test_iterable_whose_pass_changes_length_fails_clearly() -> None:
    batches = Batches(Shrinking())
    batches.batch(2, 1, 0, 1, seed=0)  # items 2, 3: through the end of pass 0
    with pytest.raises(ConfigError, match="deterministic"):
        batches.batch(2, 1, 0, 1, seed=0)  # pass 0 again, two items short of where pass 1 began


def test_loader_workers_give_the_same_batches_as_the_main_process() -> None:
    ds = tokens(sequences=24, test_sequences=0, length=4)
    steps = (0, 9)  # 24 // (2 * 2) = 6 steps per epoch: into the second epoch
    plain = list(Batches(ds).iterate(2, 2, 1, *steps, seed=3))
    loaded = list(Batches(ds, workers=2).iterate(2, 2, 1, *steps, seed=3))
    assert len(plain) == len(loaded) == 9
    for a, b in zip(plain, loaded, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    assert [values(x["input_ids"][:, 0]) for x in Batches(ds, workers=2).eval_batches(5)] == [
        values(x["input_ids"][:, 0]) for x in Batches(ds).eval_batches(5)
    ]


def test_loader_workers_with_a_stream_are_refused() -> None:
    with pytest.raises(ConfigError, match="IterableDataset"):
        Batches(Counting(3), workers=2)


def test_eval_batches_cover_every_sample_once_in_order_for_every_kind() -> None:
    n = 23
    kinds = [TensorDataset(torch.arange(n)), Items(TensorDataset(torch.arange(n))), Counting(n)]
    for ds in kinds:
        batches = list(Batches(ds).eval_batches(5))
        firsts = [x[0] if isinstance(x, tuple) else x for x in batches]
        assert [batch_samples(x) for x in batches] == [5, 5, 5, 5, 3]
        assert flat(values(x) for x in firsts) == list(range(n))


def test_batch_samples_counts_the_first_tensor_with_a_leading_size() -> None:
    batch = {"meta": "x", "scale": torch.tensor(2.0), "pair": ([7, torch.zeros(6, 3)], torch.zeros(4))}
    assert batch_samples(batch) == 6
    assert batch_samples(Pair(torch.zeros(3), torch.zeros(5))) == 3
    with pytest.raises(ConfigError, match="no tensor"):
        batch_samples({"a": [1, 2], "b": torch.tensor(1)})


def test_to_device_moves_every_nesting_and_keeps_the_rest() -> None:
    batch = {"p": Pair(torch.zeros(2), [torch.ones(1), "tag"]), "t": (torch.zeros(1, dtype=torch.float64), 3)}
    moved = to_device(batch, "meta")
    assert type(moved["p"]) is Pair and moved["p"].x.device.type == "meta"
    assert moved["p"].y[0].device.type == "meta" and moved["p"].y[1] == "tag"
    assert type(moved["t"]) is tuple and moved["t"][0].dtype == torch.float64 and moved["t"][1] == 3


def test_builtin_datasets_are_seeded_and_split() -> None:
    x, y = regression().tensors
    assert x.shape == (2048, 8) and y.shape == (2048, 1) and x.dtype == y.dtype == torch.float32
    assert torch.equal(regression("test").tensors[1], regression("test").tensors[1])
    assert not torch.equal(regression(seed=1).tensors[0], x)
    train, test = tokens(), tokens("test")
    assert (len(train), len(test)) == (2048, 256)
    assert int(train[0]["input_ids"].max()) < 32
    streamed = list(tokens_stream("test"))
    assert len(streamed) == 256 and torch.equal(streamed[5]["labels"], test[5]["labels"])


@pytest.fixture
def one_thread() -> Iterator[None]:
    # On 2 shared cores a second intra-op thread only contends: 15x slower when loaded.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tiny_lm_learns_the_token_chain(one_thread: None) -> None:
    torch.manual_seed(0)
    model = tiny_lm()
    assert model(torch.zeros(2, 32, dtype=torch.int64)).shape == (2, 32, 32)  # logits without labels
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = Batches(tokens())
    losses = []
    for step in range(100):
        loss = model(**batches.batch(16, 1, 0, step, seed=0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    start, end = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    # ln 32 = 3.47 at the start; the chain's floor is ln 2 = 0.69 (0.75 reached here)
    assert start > 3.0 and end < 1.2, (start, end)


def test_cnn_bn_has_batchnorm_buffers_and_takes_flat_digits() -> None:
    model = cnn_bn()
    buffers = dict(model.named_buffers())
    assert {"2.running_mean", "2.running_var", "2.num_batches_tracked", "5.running_mean"} <= set(buffers)
    before = buffers["2.running_mean"].clone()
    assert model(torch.rand(4, 64)).shape == (4, 10)
    assert not torch.equal(before, buffers["2.running_mean"])  # train mode updates the statistics
    assert regressor()(torch.zeros(3, 8)).shape == (3, 1)
