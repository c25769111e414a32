"""Bring your own training step: the user's optimizer, groups, schedule, clipping, buffers, step and data."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from grains.training import CoordinatorGrain, TrainingJob
from grains.training.datasets import load_dataset
from grains.training.models import build_model
from silo import errors
from silo.settings import MembershipSettings
from tests.grains.training.conftest import GRAINS, run_job

# The job of must-show 1: AdamW, no weight decay on biases, warm-up then cosine, clipping.
OWN_WAY: dict[str, Any] = {
    "optimizer": "torch.optim:AdamW",
    "lr": 0.01,
    "optimizer_args": {"weight_decay": 0.1},
    "param_groups": [{"match": "*.bias", "weight_decay": 0.0}],
    "lr_schedule": "torch.optim.lr_scheduler:CosineAnnealingLR",
    "lr_schedule_args": {"T_max": 30, "eta_min": 0.001},
    "warmup_steps": 5,
    "clip_grad_norm": 0.5,
    "batch_size": 32,
    "trainers": 2,
    "steps": 35,
    "checkpoint_every": 10,
    "seed": 7,
}


def global_batches(spec: TrainingJob, trainers: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x_all, y_all = load_dataset(spec, "train").tensors  # type: ignore[attr-defined]
    n, global_batch = len(y_all), spec.batch_size * trainers
    per_epoch = n // global_batch
    out = []
    for t in range(steps):
        epoch, i = divmod(t, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(spec.seed + epoch))
        idx = perm[i * global_batch : (i + 1) * global_batch]
        out.append((x_all[idx], y_all[idx]))
    return out


def reference_own_way(spec: TrainingJob, model: torch.nn.Module | None = None) -> torch.nn.Module:
    """The plain loop a user would write with these torch objects, on the global batches."""
    model = model if model is not None else build_model(spec)
    decay = [p for n, p in model.named_parameters() if not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias")]
    opt = torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay}], lr=0.01, weight_decay=0.1)
    warm = LinearLR(opt, start_factor=1 / 6, end_factor=1.0, total_iters=5)
    sched = SequentialLR(opt, [warm, CosineAnnealingLR(opt, T_max=30, eta_min=0.001)], milestones=[5])
    assert spec.steps is not None
    for x, y in global_batches(spec, 2, spec.steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
    return model


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
async def test_adamw_groups_warmup_cosine_and_clipping_equal_the_plain_loop(cluster, client, mode):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(**OWN_WAY, mode=mode, shards=2 if mode == "sync" else 1)
    st = await run_job(client, f"own-{mode}", spec)
    assert st.status == "completed", st
    assert st.checkpoints[-1] == 35, st  # the last step is always checkpointed
    got = await client.get_grain(CoordinatorGrain, f"own-{mode}").parameters()
    want = dict(reference_own_way(spec).named_parameters())
    assert set(got) == set(want)
    for name, w in want.items():
        # Float tolerance as in test_sync; a schedule off by one step, the wrong group's weight
        # decay, or clipping by per-shard norms is off by 1e-3 or more here.
        assert torch.allclose(got[name], w.detach(), rtol=1e-3, atol=2e-5), (name, (got[name] - w).abs().max())


# --- user step functions (import paths the silos resolve) ---------------------------------
def mse_step(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
    x, y = batch
    loss = F.mse_loss(model(x), y)
    return loss, {"mse": float(loss.detach())}


def regression_metrics(model: torch.nn.Module, batch: Any) -> dict[str, float]:
    x, y = batch
    pred = model(x)
    return {"mse": float(F.mse_loss(pred, y)), "mae": float((pred - y).abs().mean())}


def lm_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["input_ids"], labels=batch["labels"])  # type: ignore[no-any-return]


def lm_metrics(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    loss = model(batch["input_ids"], labels=batch["labels"])
    return {"loss": float(loss), "perplexity": float(torch.exp(loss))}


def vector_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")  # not a scalar: refused at submit


def nan_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    return loss * float("nan") if torch.rand(()) < 2 else loss


async def test_a_regression_job_with_an_mse_step_reports_its_metrics_by_name(cluster, client, redis_url, cluster_name):
    await cluster(2, grains=GRAINS)
    spec = TrainingJob(model="grains.training.models:regressor", dataset="grains.training.datasets:regression",
                       step=f"{__name__}:mse_step", evaluate=f"{__name__}:regression_metrics", optimizer="adam",
                       lr=0.01, steps=150, batch_size=32, trainers=2, shards=2, eval_every=50)  # fmt: skip
    st = await run_job(client, "regress", spec)
    assert st.status == "completed", st
    assert set(st.metrics) == {"mse"} and set(st.eval_metrics) == {"mse", "mae"}, st
    assert st.accuracy is None
    assert (st.steps_run, st.samples_run) == (150, 150 * 32 * 2), st  # counters: every executed step
    history = await client.get_grain(CoordinatorGrain, "regress").history()
    evals = [h.eval_metrics for h in history if h.eval_metrics is not None]
    assert evals and evals[0]["mse"] > st.eval_metrics["mse"], evals  # evaluation improved
    assert st.eval_metrics["mse"] < 0.1, st  # the targets' variance is about 1
    # The dashboard and /metrics show the job's own metrics by name, training apart from evaluation.
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from dashboard.app import create_app

    with TestClient(create_app(redis_url, cluster_name, cache_s=0.0)) as api:
        job = api.get("/api/jobs/regress").json()
        assert job["metric_names"] == {"train": ["loss", "mse"], "eval": ["mae", "mse"]}, job["metric_names"]
        points = {p["split"] for p in job["history"]}
        assert points == {"train", "eval"}
        samples = [
            s for f in text_string_to_metric_families(api.get("/metrics").text) if f.name == "redgrain_job_metric"
            for s in f.samples if s.labels["job"] == "regress"
        ]  # fmt: skip
        by = {(s.labels["split"], s.labels["name"]): s.value for s in samples}
        assert by[("eval", "mae")] == pytest.approx(st.eval_metrics["mae"]) and ("train", "mse") in by, by


async def test_a_transformer_on_dict_batches_whose_forward_returns_the_loss_learns(cluster, client):
    await cluster(2, grains=GRAINS)
    spec = TrainingJob(model="grains.training.models:tiny_lm", dataset="grains.training.datasets:tokens",
                       dataset_args={"sequences": 512, "test_sequences": 64}, step=f"{__name__}:lm_step",
                       evaluate=f"{__name__}:lm_metrics", optimizer="adamw", lr=3e-3, steps=80, batch_size=8,
                       trainers=2, shards=2, eval_batch_size=32)  # fmt: skip
    st = await run_job(client, "lm", spec, timeout_s=120)
    assert st.status == "completed", st
    test = torch.utils.data.default_collate([load_dataset(spec, "test")[i] for i in range(64)])
    with torch.no_grad():
        initial = float(lm_step(build_model(spec).eval(), test))  # about ln(vocab) = 3.5
    assert set(st.eval_metrics) == {"loss", "perplexity"} and set(st.metrics) == set(), st
    assert st.eval_metrics["loss"] < 0.5 * initial, (initial, st.eval_metrics)
    assert 0 < st.loss < 0.6 * initial, st  # the training loss (mean of the trainers' last steps) fell too


async def test_bad_steps_and_optimizers_fail_at_submit_with_the_reason(cluster, client):
    await cluster(1, grains=GRAINS)
    coord = client.get_grain(CoordinatorGrain, "bad")
    cases = {
        "scalar floating loss": {"step": f"{__name__}:vector_step"},
        "not a torch.optim.Optimizer": {"optimizer": "torch.nn:Linear"},
        "matches no trainable parameter": {"param_groups": [{"match": "encoder.*", "lr": 0.1}]},
        "takes \\(input, label\\) batches": {"dataset": "grains.training.datasets:tokens"},  # dict batches
        "mat1 and mat2 shapes cannot be multiplied": {"model_args": {"in_features": 10}},  # a batch it can't take
        "cannot import module": {"lr_schedule": "no.such.module:Sched"},
    }
    for why, fields in cases.items():
        with pytest.raises(errors.ConfigError, match=why):
            await coord.start(TrainingJob(steps=5, **fields))
    assert (await coord.status()).status == "idle"  # nothing was started, nothing half-written


async def test_a_nan_loss_fails_the_job_at_once_or_is_skipped(cluster, client):
    await cluster(2, grains=GRAINS)
    # The first step runs at submit (its loss is NaN too, but a NaN is not a contract breach).
    failing = await run_job(client, "nan-fail", TrainingJob(step=f"{__name__}:nan_step", steps=20))
    assert failing.status == "failed" and "NonFiniteLossError" in failing.error and failing.restarts == 0, failing
    skipping = await run_job(client, "nan-skip", TrainingJob(step=f"{__name__}:nan_step", steps=20, on_nonfinite="skip"))
    assert skipping.status == "completed", skipping
    before = dict(build_model(TrainingJob()).named_parameters())
    after = await client.get_grain(CoordinatorGrain, "nan-skip").parameters()
    assert all(torch.equal(after[n], p.detach()) for n, p in before.items())  # every update was skipped


def local_accuracy(model: torch.nn.Module, spec: TrainingJob) -> float:
    x, y = load_dataset(spec, "test").tensors  # type: ignore[attr-defined]
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


async def test_a_batchnorm_dropout_cnn_comes_back_whole_and_scores_as_trained_in_one_process(cluster, client):
    await cluster(2, grains=GRAINS)
    spec = TrainingJob(model="grains.training.models:cnn_bn", optimizer="adam", lr=3e-3, steps=300, batch_size=32,
                       trainers=2, shards=2, checkpoint_every=100, seed=1)  # fmt: skip
    st = await run_job(client, "bn", spec, timeout_s=180)
    assert st.status == "completed", st
    sd = await client.get_grain(CoordinatorGrain, "bn").state_dict()
    fresh = build_model(spec)
    fresh.load_state_dict(sd, strict=True)  # every parameter and buffer, nothing extra
    assert all(v.dtype in (torch.float32, torch.int64) and v.device.type == "cpu" for v in sd.values())
    bn = [k for k in sd if k.endswith("running_mean")]
    assert bn and not torch.allclose(sd[bn[0]], torch.zeros_like(sd[bn[0]])), "BatchNorm statistics were trained"
    exported = local_accuracy(fresh, spec)
    # The same model and global batches in one process (BatchNorm over 64 samples a step,
    # where each trainer normalizes its 32: the statistics differ a little, the result must not).
    local = build_model(spec)
    opt = torch.optim.Adam(local.parameters(), lr=3e-3)
    for x, y in global_batches(spec, 2, 300):
        opt.zero_grad()
        F.cross_entropy(local(x), y).backward()
        opt.step()
    in_one_process = local_accuracy(local, spec)
    assert abs(exported - in_one_process) <= 0.01, (exported, in_one_process)
    assert st.accuracy is not None and abs(st.accuracy - in_one_process) <= 0.01, (st.accuracy, in_one_process)
    assert st.accuracy == pytest.approx(exported, abs=1e-6)  # the reported figure is the exported model's


class FrozenFirst(torch.nn.Module):
    """The digits MLP with its first layer frozen (fine-tuning the head)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 10)
        self.body.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def frozen_first() -> torch.nn.Module:
    return FrozenFirst()


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
async def test_saved_weights_start_a_new_job_and_a_frozen_layer_stays_bit_identical(cluster, client, tmp_path, mode):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    base = {"model": f"{__name__}:frozen_first", "optimizer": "momentum", "lr": 0.05, "weight_decay": 1e-3,
            "batch_size": 32, "trainers": 2, "mode": mode, "checkpoint_every": 10, "seed": 2}  # fmt: skip
    first = TrainingJob(**base, steps=20)
    st = await run_job(client, f"first-{mode}", first)
    assert st.status == "completed", st
    coord = client.get_grain(CoordinatorGrain, f"first-{mode}")
    sd = await coord.state_dict()
    seeded = build_model(first)
    # Frozen: no gradient sent, no weight decay or momentum applied: exactly the seeded values.
    for k in ("body.weight", "body.bias"):
        assert torch.equal(sd[k], seeded.state_dict()[k]), k
    assert not torch.equal(sd["head.weight"], seeded.state_dict()["head.weight"])
    path = tmp_path / "first.pt"
    torch.save(sd, path)
    # Fine-tuning from the saved file equals a plain loop started from the same weights.
    second = TrainingJob(**{**base, "seed": 3}, steps=15, init_from=str(path))
    st2 = await run_job(client, f"second-{mode}", second)
    assert st2.status == "completed" and st2.resumed_from == 0, st2
    got = await client.get_grain(CoordinatorGrain, f"second-{mode}").state_dict()
    ref = build_model(second)
    ref.load_state_dict(torch.load(path, weights_only=True))
    opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.05, momentum=0.9, weight_decay=1e-3)
    for x, y in global_batches(second, 2, 15):
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, rtol=1e-4, atol=1e-5), k
    assert torch.equal(got["body.weight"], sd["body.weight"])  # still frozen, still the first job's


async def wait_until(predicate: Any, timeout_s: float = 10.0) -> None:
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
async def test_a_finished_job_frees_its_trainers_and_shards_and_stays_readable(cluster, client, mode):
    silos = await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(mode=mode, trainers=2, shards=2, steps=12, checkpoint_every=0, batch_size=16)
    st = await run_job(client, f"free-{mode}", spec)
    # checkpoint_every 0: still the last step; a PS start commits the seeded weights as 0 (each
    # shard restores its slice of them), all-reduce ranks hold the whole model anyway.
    assert st.status == "completed" and st.checkpoints == ([0, 12] if mode == "sync" else [12]), st

    def training_grains() -> list[str]:
        return [a.grain_key for s in silos for a in s.catalog.activations()
                if "Trainer" in a.grain_key or "ParamShard" in a.grain_key]  # fmt: skip

    await wait_until(lambda: not training_grains())
    coord = client.get_grain(CoordinatorGrain, f"free-{mode}")
    sd = await coord.state_dict()  # read from the final checkpoint
    assert set(sd) == set(build_model(spec).state_dict()) and not training_grains()


def stream_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    loss = model(batch["input_ids"], labels=batch["labels"])
    return loss, {"tokens": float(batch["input_ids"].numel())}


@pytest.mark.parametrize(("mode", "precision"), [("ssp", "bf16"), ("allreduce", "fp16")])
async def test_an_iterable_dataset_trains_at_reduced_precision(cluster, client, mode, precision):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(model="grains.training.models:tiny_lm", dataset="grains.training.datasets:tokens_stream",
                       dataset_args={"sequences": 256, "test_sequences": 32}, step=f"{__name__}:stream_step",
                       evaluate=f"{__name__}:lm_metrics", optimizer="adamw", lr=3e-3, steps=60, batch_size=8,
                       trainers=2, shards=2, mode=mode, precision=precision)  # fmt: skip
    st = await run_job(client, f"stream-{mode}", spec, timeout_s=120)
    assert st.status == "completed", st
    assert st.metrics == {"tokens": 8 * 32.0}, st  # the step's own metric, averaged over trainers
    assert st.eval_metrics["loss"] < 2.4, st  # from about ln(32) = 3.5
    assert st.epoch == 0.0  # a stream has no length
    with pytest.raises(errors.ConfigError, match="needs 'steps'"):
        await client.get_grain(CoordinatorGrain, "stream-epochs").start(spec.model_copy(update={"steps": None, "epochs": 1.0}))


async def test_fp16_with_loss_scaling_trains_in_parameter_server_mode_as_fp32_does(cluster, client):
    await cluster(2, grains=GRAINS)
    spec = TrainingJob(steps=150, trainers=2, shards=2, batch_size=32, optimizer="momentum", lr=0.05)
    full = await run_job(client, "fp32-ps", spec)
    # A loss scale of 2**24 overflows fp16 at once: the first steps are skipped (on every shard)
    # while it halves, and it grows back into overflow every 50 clean steps.
    half = await run_job(client, "fp16-ps", spec.model_copy(update={"precision": "fp16", "loss_scale": 2.0**24,
                                                                    "loss_scale_growth_interval": 50}))
    assert full.status == half.status == "completed", (full, half)
    assert full.skipped == 0 and 4 <= half.skipped <= 30, half
    assert full.accuracy is not None and half.accuracy is not None and full.accuracy >= 0.9, full
    assert abs(half.accuracy - full.accuracy) <= 0.02, (half.accuracy, full.accuracy)


_OOM_ONCE = {"left": 1}


def oom_once_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Out of memory on the first trainer to get past step 5 (one process: the in-process silos)."""
    x, y = batch
    if _OOM_ONCE["left"] and not torch.is_inference_mode_enabled():
        steps = getattr(model, "_rg_calls", 0) + 1
        model._rg_calls = steps  # type: ignore[assignment]
        if steps > 5:
            _OOM_ONCE["left"] = 0
            raise MemoryError("simulated: no memory for this batch")
    return F.cross_entropy(model(x), y)


@pytest.mark.parametrize(("mode", "trainers"), [("sync", "auto"), ("allreduce", "auto"), ("sync", 2)])
async def test_out_of_memory_sheds_the_trainer_of_an_elastic_job_and_fails_a_fixed_one(cluster, client, mode, trainers):
    _OOM_ONCE["left"] = 1
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(step=f"{__name__}:oom_once_step", mode=mode, trainers=trainers, steps=40, checkpoint_every=10)
    st = await run_job(client, f"oom-{mode}-{trainers}", spec, timeout_s=120)
    if trainers == "auto":
        assert st.status == "completed" and st.trainers == 1, st  # went on without the shed trainer
        assert any("shed" in c.reason or "broken" in c.reason for c in st.changes), st.changes
    else:
        assert st.status == "failed" and "MemoryError" in st.error and st.restarts == 0, st


async def test_loader_workers_give_the_same_training_as_loading_in_the_trainer(cluster, client):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    from samples.custom_model import JOB

    spec = TrainingJob.model_validate({**JOB, "epochs": None, "steps": 20, "checkpoint_every": 0})
    plain = await run_job(client, "load-plain", spec)
    workers = await run_job(client, "load-workers", spec.model_copy(update={"loader_workers": 2}))
    assert plain.status == workers.status == "completed", (plain, workers)
    a = await client.get_grain(CoordinatorGrain, "load-plain").parameters()
    b = await client.get_grain(CoordinatorGrain, "load-workers").parameters()
    for name in a:  # the same batches in the same order: the same sync training
        assert torch.allclose(a[name], b[name], rtol=1e-4, atol=1e-6), name


async def test_trainers_time_their_exchanges(cluster, client):
    await cluster(2, grains=GRAINS)
    st = await run_job(client, "waits", TrainingJob(steps=30, trainers=2, shards=2, batch_size=16))
    # In sync mode a step waits for both trainers' pushes: never nothing, never a whole second.
    assert st.status == "completed" and 0 < st.exchange_ms_per_step < 1000, st


async def test_state_dict_of_a_committed_checkpoint_is_that_steps_weights(cluster, client):
    await cluster(1, grains=GRAINS)
    spec = TrainingJob(trainers=1, shards=1, steps=12, checkpoint_every=6, batch_size=16)
    st = await run_job(client, "at-step", spec)
    assert st.status == "completed" and st.checkpoints[-2:] == [6, 12], st
    # The same job stopped at step 6 (one trainer: the same batches and updates) is what step 6 holds.
    st6 = await run_job(client, "to-six", spec.model_copy(update={"steps": 6}))
    assert st6.status == "completed", st6
    coord = client.get_grain(CoordinatorGrain, "at-step")
    at6, final = await coord.state_dict(step=6), await coord.state_dict()
    want6 = await client.get_grain(CoordinatorGrain, "to-six").state_dict()
    for k in want6:
        assert torch.allclose(at6[k], want6[k], atol=1e-6), k
    assert all(torch.equal(final[k], v) for k, v in (await coord.state_dict(step=12)).items())
    assert not torch.allclose(at6["1.weight"], final["1.weight"])
    with pytest.raises(errors.ConfigError, match="no committed checkpoint at step 7"):
        await coord.state_dict(step=7)
