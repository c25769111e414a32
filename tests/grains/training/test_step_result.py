"""What a step may return: a loss, (loss, metrics), or a Hugging Face ModelOutput carrying `loss`."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_outputs import SequenceClassifierOutput

from grains.training.loop.program import TrainingStepError, split_result
from tests.grains.training import hf_task


def test_the_hf_one_line_step_returning_the_model_output_is_a_step() -> None:
    model = hf_task.model()
    batch = hf_task.pad([hf_task.sequences("test")[i] for i in range(4)])
    out = model(**batch)  # `return model(**batch)`, as docs/training.md shows
    assert isinstance(out, SequenceClassifierOutput)
    loss, metrics = split_result(out)
    assert torch.equal(loss, out.loss) and loss.requires_grad and metrics == {}


def test_a_model_output_without_a_loss_is_refused_with_what_it_was() -> None:
    out = SequenceClassifierOutput(logits=torch.zeros(2, 2, requires_grad=True))
    with pytest.raises(TrainingStepError, match="not SequenceClassifierOutput"):
        split_result(out)
