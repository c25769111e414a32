"""Porting a real script: a transformers model fine-tuned through redgrain, with torchmetrics.

The model is built from a config (nothing downloaded); the dataset yields token
lists of varying length that the job's ``collate_fn`` pads per batch into the
dict an HF model takes; the evaluation returns torchmetrics objects, which
redgrain merges over the test split, so F1 is the split's, not a mean of
per-batch F1s (the split is evaluated in batches of 16 here).
"""

from __future__ import annotations

import pytest
import torch
from torchmetrics.classification import BinaryF1Score

from grains.training import CoordinatorGrain, TrainingJob
from silo.settings import MembershipSettings
from tests.grains.training import hf_task
from tests.grains.training.conftest import GRAINS, run_job

TASK = "tests.grains.training.hf_task"


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
async def test_a_transformers_model_fine_tunes_on_padded_token_lists_with_torchmetrics(cluster, client, mode):
    await cluster(2, grains=GRAINS, membership=MembershipSettings())
    spec = TrainingJob(model=f"{TASK}:model", dataset=f"{TASK}:sequences", collate_fn=f"{TASK}:pad",
                       step=f"{TASK}:step", evaluate=f"{TASK}:evaluate", optimizer="adamw", lr=3e-3,
                       batch_size=16, trainers=2, steps=80, mode=mode, eval_batch_size=16,
                       checkpoint_every=40, seed=1)  # fmt: skip
    st = await run_job(client, f"hf-{mode}", spec, timeout_s=180)
    assert st.status == "completed", st
    assert st.eval_metrics["accuracy"] > 0.9, st
    # The merged F1 equals the F1 of the whole split, computed here from the exported weights.
    model = hf_task.model()
    model.load_state_dict(await client.get_grain(CoordinatorGrain, f"hf-{mode}").state_dict(), strict=True)
    model.eval()
    test = hf_task.sequences("test")
    whole = hf_task.pad([test[i] for i in range(len(test))])
    with torch.no_grad():
        preds = model(input_ids=whole["input_ids"], attention_mask=whole["attention_mask"]).logits.argmax(-1)
    f1 = BinaryF1Score()
    f1.update(preds, whole["labels"])
    assert st.eval_metrics["f1"] == pytest.approx(float(f1.compute()), abs=1e-6), st.eval_metrics
