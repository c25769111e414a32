"""A Hugging Face-style fine-tune ported to redgrain, run beside the plain loop it replaces.

The script being ported: a BERT built from a config (nothing downloaded),
variable-length token lists padded per batch by a ``collate_fn``, AdamW with
no weight decay on biases and LayerNorm weights, HF's
``get_linear_schedule_with_warmup``, gradient clipping, accumulation 2,
torchmetrics F1 over the test split and early stopping on it. Where each
piece of the HF ``Trainer`` went:

- ``model_init`` (``BertForSequenceClassification``): ``model = "samples.hf_finetune:tiny_bert"``
- the ``datasets`` split: ``dataset = "samples.hf_finetune:token_pairs"``
- ``DataCollatorWithPadding``: ``collate_fn = "samples.hf_finetune:pad"``
- ``compute_loss`` (``model(**batch).loss``): ``step = "samples.hf_finetune:compute_loss"``
- ``compute_metrics``: ``evaluate``, returning torchmetrics objects
- the no-decay parameter groups: ``param_groups`` (globs over parameter names)
- ``lr_scheduler_type="linear"``, ``warmup_steps``: ``lr_schedule`` = HF's own factory, ``warmup_steps``
- ``max_grad_norm``: ``clip_grad_norm``
- ``gradient_accumulation_steps``: ``grad_accumulation``
- ``per_device_train_batch_size`` on 2 GPUs (DDP): ``batch_size`` on 2 ``trainers``
- ``eval_steps``, ``save_steps``: ``eval_every``, ``checkpoint_every``
- ``EarlyStoppingCallback``: ``callbacks = ["samples.hf_finetune:EarlyStopping"]``

Run it (an embedded Redis and 2 silo processes; the silos import this module
by path, as they import any user code)::

    python -m samples.hf_finetune                      # sync and allreduce, each against the plain loop
    python -m samples.hf_finetune --steps 32 --eval-steps 4 --mode sync

For each mode it prints the job's F1 and loss on the test split beside those
of a plain single-process PyTorch loop over the same data, seed and global
batch (what the HF ``Trainer`` does on 2 devices), where each ended, and the
largest differences between the two models' test logits and weights; it
exits 1 when they differ by more than float noise (``compare``). Dropout is off in the config: redgrain draws dropout masks from
``(seed, step, rank)`` (docs/training.md, "Random draws"), which a
one-process loop cannot reproduce, and this comparison is about the math.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PAD, FIRST, SECOND, VOCAB = 0, 5, 6, 48
TRAIN_SIZE, TEST_SIZE = 2048, 512


# ---- the HF script's pieces, unchanged but for being named by import path -----------------------


def tiny_bert() -> nn.Module:
    """A 2-layer BERT from a config; dropout off (see the module docstring)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=40, num_labels=2, pad_token_id=PAD,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # type: ignore[call-arg]  # fmt: skip
    return BertForSequenceClassification(config)


class TokenPairs(Dataset[tuple[list[int], int]]):
    """Token lists of 6 to 32 tokens holding tokens 5 and 6 once each: is 5 before 6?

    Made from the seed (nothing downloaded); an order question, so a bag of
    tokens cannot answer it and the F1 has room to move.
    """

    def __init__(self, size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items: list[tuple[list[int], int]] = []
        for _ in range(size):
            length = int(torch.randint(6, 33, (1,), generator=g))
            tokens = torch.randint(8, VOCAB, (length,), generator=g)
            a, b = torch.randperm(length, generator=g)[:2].tolist()
            tokens[a], tokens[b] = FIRST, SECOND
            self.items.append((tokens.tolist(), int(a < b)))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[list[int], int]:
        return self.items[i]


def token_pairs(split: str = "train", size: int = TRAIN_SIZE) -> TokenPairs:
    return TokenPairs(size, seed=1) if split == "train" else TokenPairs(TEST_SIZE, seed=2)


def pad(items: list[tuple[list[int], int]]) -> dict[str, torch.Tensor]:
    """``DataCollatorWithPadding``: pad to the batch's longest, with an attention mask."""
    longest = max(len(t) for t, _ in items)
    ids = torch.full((len(items), longest), PAD, dtype=torch.long)
    mask = torch.zeros((len(items), longest), dtype=torch.long)
    for row, (tokens, _) in enumerate(items):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([y for _, y in items])}


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss  # type: ignore[no-any-return]


def compute_metrics(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One test batch; torchmetrics objects, which redgrain merges over the split (exact F1)."""
    from torchmetrics.classification import BinaryAccuracy, BinaryF1Score

    out = model(**batch)
    preds = out.logits.argmax(-1)
    f1, acc = BinaryF1Score(), BinaryAccuracy()
    f1.update(preds, batch["labels"])
    acc.update(preds, batch["labels"])
    return {"f1": f1, "accuracy": acc, "loss": float(out.loss)}


class EarlyStopping:
    """HF's ``EarlyStoppingCallback(early_stopping_patience=3)`` on ``f1``: stop after 3
    evaluations in a row that did not beat the best. Made once per job on the coordinator's silo."""

    metric, patience = "f1", 3

    def __init__(self) -> None:
        self.best: float | None = None
        self.bad = 0

    def on_eval(self, step: int, metrics: dict[str, float]) -> bool:
        value = metrics[self.metric]
        if self.best is None or value > self.best:
            self.best, self.bad = value, 0
        else:
            self.bad += 1
        return self.bad >= self.patience


# ---- the training arguments, and the job they make -------------------------------------------------


@dataclass(frozen=True)
class Args:
    """The HF ``TrainingArguments`` of the script (per device: 2 devices)."""

    steps: int = 160
    per_device_batch: int = 16
    devices: int = 2
    accumulation: int = 2
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 16
    max_grad_norm: float = 1.0
    eval_steps: int = 16
    eval_batch: int = 128
    train_size: int = TRAIN_SIZE
    seed: int = 1

    @property
    def global_batch(self) -> int:
        return self.per_device_batch * self.devices * self.accumulation


NO_DECAY = ("bias", "LayerNorm.weight")
"""HF's usual rule: a parameter whose name contains one of these takes no weight decay."""


def job(args: Args, mode: str) -> dict[str, Any]:
    here = "samples.hf_finetune"
    return {
        "model": f"{here}:tiny_bert",
        "dataset": f"{here}:token_pairs",
        "dataset_args": {"size": args.train_size},
        "collate_fn": f"{here}:pad",
        "step": f"{here}:compute_loss",
        "evaluate": f"{here}:compute_metrics",
        "eval_batch_size": args.eval_batch,
        "optimizer": "adamw",
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "param_groups": [{"match": [f"*{n}*" for n in NO_DECAY], "weight_decay": 0.0}],
        "lr_schedule": "transformers:get_linear_schedule_with_warmup",
        "warmup_steps": args.warmup_steps,
        "clip_grad_norm": args.max_grad_norm,
        "grad_accumulation": args.accumulation,
        "batch_size": args.per_device_batch,
        "trainers": args.devices,
        "shards": 2,
        "mode": mode,
        "steps": args.steps,
        "eval_every": args.eval_steps,
        "checkpoint_every": args.eval_steps,
        "callbacks": [f"{here}:EarlyStopping"],
        "seed": args.seed,
    }


# ---- the plain loop: one process, the same global batches ---------------------------------------


def global_batches(n: int, size: int, seed: int, steps: int) -> Iterator[list[int]]:
    """The indices of each step's global batch: epoch ``e`` is ``randperm(n)`` seeded ``seed + e``,
    cut into whole batches (docs/training.md, "The batch schedule")."""
    per_epoch = n // size
    for t in range(steps):
        epoch, i = divmod(t, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        yield perm[i * size : (i + 1) * size].tolist()


def seeded(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """The model a job with this seed starts from (its factory under ``manual_seed(seed)``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


@dataclass
class Outcome:
    """Where a run ended: the metrics on the test split, the step, the weights."""

    metrics: dict[str, float]
    step: int
    stopped_early: bool
    weights: dict[str, torch.Tensor]


def plain_evaluate(model: nn.Module, test: Dataset[Any], batch: int) -> dict[str, float]:
    """F1 and accuracy over the whole split, loss as the mean over its samples."""
    from torchmetrics.classification import BinaryAccuracy, BinaryF1Score

    model.eval()
    f1, acc, loss_sum, n = BinaryF1Score(), BinaryAccuracy(), 0.0, len(test)  # type: ignore[arg-type]
    with torch.no_grad():
        for s in range(0, n, batch):
            b = pad([test[i] for i in range(s, min(s + batch, n))])
            out = model(**b)
            f1.update(out.logits.argmax(-1), b["labels"])
            acc.update(out.logits.argmax(-1), b["labels"])
            loss_sum += float(out.loss) * len(b["labels"])
    model.train()
    return {"f1": float(f1.compute()), "accuracy": float(acc.compute()), "loss": loss_sum / n}


def plain_finetune(args: Args) -> Outcome:
    """What the HF ``Trainer`` does with these arguments, written out in plain PyTorch."""
    from transformers import get_linear_schedule_with_warmup

    model = seeded(tiny_bert, args.seed)
    train, test = token_pairs("train", args.train_size), token_pairs("test")
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not any(nd in n for nd in NO_DECAY)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if any(nd in n for nd in NO_DECAY)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    schedule = get_linear_schedule_with_warmup(opt, args.warmup_steps, args.steps)
    stopper = EarlyStopping()
    micro = args.global_batch // args.accumulation
    model.train()
    for t, idx in enumerate(global_batches(len(train), args.global_batch, args.seed, args.steps)):
        for m in range(args.accumulation):
            batch = pad([train[i] for i in idx[m * micro : (m + 1) * micro]])
            (compute_loss(model, batch) / args.accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        schedule.step()
        opt.zero_grad()
        step = t + 1
        if step % args.eval_steps == 0 and step < args.steps:
            metrics = plain_evaluate(model, test, args.eval_batch)
            if stopper.on_eval(step, metrics):
                return Outcome(metrics, step, True, _weights(model))
    return Outcome(plain_evaluate(model, test, args.eval_batch), args.steps, False, _weights(model))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- redgrain: the same job on a cluster --------------------------------------------------------


async def run_job(redis_url: str, cluster: str, job_id: str, spec: dict[str, Any]) -> Outcome:
    from grains.training import CoordinatorGrain, TrainingJob
    from grains.training.console import watch
    from silo import ClusterClient

    async with await ClusterClient.connect(redis_url, cluster=cluster) as client:
        coord = client.get_grain(CoordinatorGrain, job_id)
        await coord.start(TrainingJob.model_validate(spec))
        st = await watch(coord, timeout_s=600)
        if st.status != "completed":
            raise RuntimeError(f"job {job_id} {st.status}: {st.error or st}")
        weights = await coord.state_dict()
    step = st.eval_step if st.eval_step is not None else st.step
    return Outcome(dict(st.eval_metrics), step, bool(st.stopped_early), weights)


NOISE_ONLY = "*.attention.self.key.bias"
"""Weights the loss does not depend on in exact arithmetic: a key bias adds one constant to all
of a query's scores, which softmax ignores. Their gradient is float noise that AdamW scales up
to steps of the learning rate's size, so they drift apart between any two runs (3.7e-3 after
160 steps, where every other weight agrees within 1.3e-6); the comparison leaves them out."""


def split_logits(model: nn.Module, weights: dict[str, torch.Tensor], batch: int) -> torch.Tensor:
    """The model's logits over the test split with ``weights`` loaded (strictly)."""
    model.load_state_dict(weights, strict=True)
    model.eval()
    test = token_pairs("test")
    parts = []
    with torch.no_grad():
        for s in range(0, len(test), batch):
            b = pad([test[i] for i in range(s, min(s + batch, len(test)))])
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
            parts.append(getattr(out, "logits", out))
    return torch.cat(parts)


@dataclass(frozen=True)
class Comparison:
    """A job against the plain loop: how far apart their models are."""

    line: str
    logits: float
    """The largest difference between the two models' logits over the test split."""
    weights: float
    """The largest difference between their weights, ``NOISE_ONLY`` left out."""
    same: bool
    """Equal to float noise: the same stop, logits and loss within ``TOLERANCE``, weights within
    ``WEIGHT_TOLERANCE``, F1 within a few of the 512 predictions (a logit at the boundary may flip)."""


TOLERANCE = 1e-3
"""Logits and loss: float noise (trainers sum in another order, pad to other lengths) stays
well below; no warmup moves the logits by 0.1 in 24 steps."""
WEIGHT_TOLERANCE = 1e-4
"""Weights but ``NOISE_ONLY``: float noise is ~1e-6; decay on the no-decay group (a spec without
its ``param_groups``) moves them by 3.6e-3 in 24 steps, while the logits move only by 7.7e-4."""


def compare(mode: str, got: Outcome, want: Outcome, model: Callable[[], nn.Module], eval_batch: int) -> Comparison:
    import fnmatch

    dw = max(
        (float((got.weights[k] - want.weights[k]).abs().max()) for k in want.weights if not fnmatch.fnmatchcase(k, NOISE_ONLY)),
        default=0.0,
    )
    dl = float((split_logits(model(), got.weights, eval_batch) - split_logits(model(), want.weights, eval_batch)).abs().max())

    def figures(o: Outcome) -> str:
        end = f"stopped early at step {o.step}" if o.stopped_early else f"ran to step {o.step}"
        shown = " ".join(f"{k} {o.metrics[k]:.6f}" for k in ("f1", "accuracy", "loss") if k in o.metrics)
        return f"{shown} ({end})"

    same = (
        dl < TOLERANCE
        and dw < WEIGHT_TOLERANCE
        and (got.step, got.stopped_early) == (want.step, want.stopped_early)
        and abs(got.metrics["loss"] - want.metrics["loss"]) < TOLERANCE
        and abs(got.metrics["f1"] - want.metrics["f1"]) < 1e-2
    )
    line = f"{mode}: redgrain {figures(got)} | plain loop {figures(want)} | max |dlogit| {dl:.2e} max |dw| {dw:.2e}"
    return Comparison(line, dl, dw, same)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", action="append", choices=["sync", "allreduce", "async", "ssp"],
                        help="modes to run (repeat; default sync and allreduce)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=Args.steps)
    parser.add_argument("--eval-steps", type=int, default=Args.eval_steps)
    opts = parser.parse_args(argv)
    args = Args(steps=opts.steps, eval_steps=opts.eval_steps)
    modes = opts.mode or ["sync", "allreduce"]
    from silo.testing.local import LocalCluster

    # The plain loop shares the machine with two silos: at torch's default of a thread per core
    # the three fight over the cores (24 steps took 69 s instead of 12 on a busy 2-core machine).
    torch.set_num_threads(1)
    os.chdir(ROOT)  # the silos import samples.hf_finetune from here
    want = plain_finetune(args)
    ok = True
    with LocalCluster("grains.training", silos=2, cluster="hf-sample", persist=False) as lc:
        for mode in modes:
            got = asyncio.run(run_job(lc.redis_url, lc.cluster, f"hf-{mode}", job(args, mode)))
            c = compare(mode, got, want, tiny_bert, args.eval_batch)
            print(c.line, flush=True)
            ok = ok and (mode not in ("sync", "allreduce") or c.same)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
