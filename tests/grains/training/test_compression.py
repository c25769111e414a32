"""Compression: the payloads each kind puts on the wire, error feedback, and (on a cluster)
that top-k with error feedback trains as well as uncompressed gradients on digits.

The cluster test runs sync mode with a fixed seed, which makes both runs deterministic,
so the comparison is exact for this seed; the configuration is the shortest where the
claim held for every one of 30 seeds in an offline replay of the same math (see
docs/training.md, "Compression").
"""

from __future__ import annotations

import pytest
import torch

from grains.training import TrainingJob
from grains.training.api.job import parse_compression
from grains.training.loop.compression import Compressor, decompress_into, payload_nbytes
from silo.errors import ConfigError
from silo.settings import MembershipSettings
from tests.grains.training.conftest import GRAINS, run_job


def test_topk_with_fp16_values_parses_to_topk_with_a_half_precision_value_dtype():
    spec = parse_compression(" TopK:0.05:FP16 ")
    assert (spec.kind, spec.ratio, spec.value_dtype, spec.pull_dtype) == ("topk", 0.05, torch.float16, torch.float16)
    plain = parse_compression("topk:0.05")
    assert (plain.kind, plain.value_dtype) == ("topk", torch.float32)
    assert parse_compression("fp16").value_dtype == torch.float32  # dense kinds: dtype follows the kind


@pytest.mark.parametrize(
    "text", ["topk", "topk:", "topk:0", "topk:1.5", "topk:nan", "topk:x:fp16", "topk:0.01:bf16", "topk:0.01:fp16:x",
             "topk:0.01:", "fp16:topk", "fp32"],
)  # fmt: skip
def test_malformed_compression_is_a_config_error_naming_the_text(text):
    with pytest.raises(ConfigError, match="bad compression") as info:
        parse_compression(text)
    assert repr(text) in str(info.value)


def test_topk_with_fp16_values_sends_two_bytes_per_value_and_four_per_index():
    grad = torch.randn(1000)
    fp32 = Compressor(parse_compression("topk:0.01")).compress("w", grad.clone())
    fp16 = Compressor(parse_compression("topk:0.01:fp16")).compress("w", grad.clone())
    assert isinstance(fp16, list) and isinstance(fp32, list)
    values, idx = fp16
    assert (values.dtype, idx.dtype, values.numel(), idx.numel()) == (torch.float16, torch.int32, 10, 10)
    assert payload_nbytes(fp16) == 10 * (2 + 4)
    assert payload_nbytes(fp32) == 10 * (4 + 4)
    assert torch.equal(idx.sort().values, fp32[1].sort().values)  # the same entries, only narrower


@pytest.mark.parametrize("kind", ["topk:0.05", "topk:0.05:fp16", "fp16", "bf16"])
def test_what_was_sent_plus_the_residual_is_the_sum_of_the_true_gradients(kind):
    # Error feedback loses nothing: after any number of steps, the decompressed payloads
    # and the residual together add up to every gradient the trainer computed.
    torch.manual_seed(0)
    comp = Compressor(parse_compression(kind))
    true = torch.zeros(3, 200, dtype=torch.float64)
    sent = torch.zeros(3, 200)
    for _ in range(40):
        g = torch.randn(3, 200) * 1e-3  # small, so fp16 rounding errors are not all zero
        true += g.double()
        step = torch.zeros(3, 200)
        decompress_into(step, comp.compress("w", g.clone()), add=False)
        sent += step
    total = sent.double() + comp.residual()["w"].double()
    assert torch.allclose(total, true, rtol=0, atol=1e-8), (total - true).abs().max()
    # ... and something is still held back, so the residual mattered.
    assert comp.residual()["w"].abs().max() > 0


def test_topk_fp16_keeps_the_rounding_error_of_the_sent_values_in_the_residual():
    comp = Compressor(parse_compression("topk:0.5:fp16"))
    grad = torch.tensor([1.0 + 2**-12, 0.0, -3.0 - 2**-10, 1e-4])  # the first and third don't fit in fp16
    values, idx = comp.compress("w", grad.clone())  # type: ignore[misc]
    assert sorted(idx.tolist()) == [0, 2] and values.dtype == torch.float16
    res = comp.residual()["w"]
    assert res[0] == 2**-12 and res[2] == -(2**-10)  # the part fp16 could not carry
    assert res[1] == 0.0 and res[3] == pytest.approx(1e-4)  # unsent entries stay whole


def test_topk_fp16_clamps_a_value_beyond_fp16_range_and_keeps_the_excess():
    comp = Compressor(parse_compression("topk:0.5:fp16"))
    values, _ = comp.compress("w", torch.tensor([1e6, 1.0]))  # type: ignore[misc]
    assert torch.isfinite(values).all() and float(values[0]) == 65504.0
    assert float(comp.residual()["w"][0]) == 1e6 - 65504.0


def test_decompress_accepts_fp16_values_into_an_fp32_tensor_and_adds_to_it():
    acc = torch.ones(6)
    decompress_into(acc, [torch.tensor([0.5, -2.0], dtype=torch.float16), torch.tensor([1, 4], dtype=torch.int32)], add=True)
    assert acc.tolist() == [1.0, 1.5, 1.0, 1.0, -1.0, 1.0]
    decompress_into(acc, [torch.tensor([0.25], dtype=torch.float16), torch.tensor([5], dtype=torch.int32)], add=False)
    assert acc.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 0.25]


def test_allreduce_refuses_topk_with_fp16_values_as_it_refuses_topk():
    # allreduce has no shard to scatter a sparse push into; the job spec's check goes by kind.
    with pytest.raises(ValueError, match="needs a parameter server"):
        TrainingJob(mode="allreduce", compression="topk:0.01:fp16")
    TrainingJob(mode="sync", compression="topk:0.01:fp16")


# Plain SGD at lr 0.3: digits' MLP reaches ~96% in 300 global steps of 2 x 64 samples.
SPEC = {"mode": "sync", "trainers": 2, "shards": 2, "steps": 300, "batch_size": 64, "optimizer": "sgd", "lr": 0.3,
        "checkpoint_every": 0, "seed": 0}  # fmt: skip


async def test_topk_with_error_feedback_reaches_within_a_point_of_uncompressed_accuracy(cluster, client):
    silos = await cluster(2, grains=GRAINS, membership=MembershipSettings())
    for silo in silos:  # both silos must see each other before the jobs place their shards
        await silo.view.refresh()
    dense = await run_job(client, "dense", TrainingJob(**SPEC, compression="none"))
    topk = await run_job(client, "topk", TrainingJob(**SPEC, compression="topk:0.01"))
    assert dense.status == topk.status == "completed", (dense, topk)
    assert dense.rollbacks == topk.rollbacks == 0 and dense.restarts == topk.restarts == 0
    assert dense.accuracy is not None and topk.accuracy is not None
    assert dense.accuracy >= 0.95, dense  # both runs trained: the comparison means something
    assert topk.accuracy >= dense.accuracy - 0.01, (topk.accuracy, dense.accuracy)
    # ... while pushing 1% of the gradient entries (plus their indices) and pulling fp16.
    assert topk.bytes_per_step * 3 < dense.bytes_per_step, (topk.bytes_per_step, dense.bytes_per_step)


def test_dense_fp16_clamps_a_huge_gradient_and_keeps_the_excess_for_later():
    from grains.training.loop.compression import Compressor

    c = Compressor(parse_compression("fp16"))
    sent = c.compress("w", torch.tensor([1e6, 1.0]))
    assert isinstance(sent, torch.Tensor) and torch.isfinite(sent).all()
    assert float(sent[0]) == 65504.0 and float(c.residual()["w"][0]) == 1e6 - 65504.0


def test_clipping_bounds_what_is_sent_once_the_residual_is_added_back():
    # async/ssp trainers clip their own gradient; with error feedback, what is sent is the
    # gradient plus the residual, so clipping must come after that sum, or the bound fails.
    from grains.training.api.job import TrainingJob
    from grains.training.loop.compression import Compressor, decompress_into
    from grains.training.loop.step_runner import StepRunner

    torch.manual_seed(0)
    runner = StepRunner(TrainingJob(mode="async", clip_grad_norm=1.0), "cpu", [])
    comp = Compressor(parse_compression("topk:0.1"))
    comp.restore({"w": torch.randn(1000) * 5})  # a residual saved from earlier steps
    grads = {"w": torch.randn(1000)}
    runner.clip_tensors(comp.add_residual(grads).values())
    sent = torch.zeros(1000)
    decompress_into(sent, comp.compress("w", grads["w"]), add=False)
    assert float(sent.norm()) <= 1.0 + 1e-5
    assert float(sent.norm()) > 0.5  # and something was sent
    # The old order (clip, then add the residual back, then compress) sends far more than the bound.
    comp.restore({"w": torch.randn(1000) * 5})
    g = torch.randn(1000)
    g.mul_(min(1.0, 1.0 / float(g.norm())))
    decompress_into(sent, comp.compress("w", g), add=False)
    assert float(sent.norm()) > 2.0
