"""A transformers model fine-tuned as a user would port an HF script: built from a config (nothing
downloaded), variable-length token lists padded per batch by a ``collate_fn``, torchmetrics metrics.

The task: does token 7 occur in the sequence? (Lengths 4 to 24, vocabulary 40.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset
from torchmetrics.classification import BinaryAccuracy, BinaryF1Score
from transformers import BertConfig, BertForSequenceClassification

PAD = 0
MARK = 7


def model() -> torch.nn.Module:
    config = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD)  # fmt: skip
    return BertForSequenceClassification(config)


class Sequences(Dataset[tuple[list[int], int]]):
    def __init__(self, split: str = "train", size: int = 512) -> None:
        g = torch.Generator().manual_seed(1 if split == "train" else 2)
        n = size if split == "train" else 200
        self.items: list[tuple[list[int], int]] = []
        for i in range(n):
            length = int(torch.randint(4, 25, (1,), generator=g))
            tokens = torch.randint(8, 40, (length,), generator=g)
            label = i % 2
            if label:
                tokens[int(torch.randint(0, length, (1,), generator=g))] = MARK
            self.items.append((tokens.tolist(), label))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[list[int], int]:
        return self.items[i]


def sequences(split: str = "train", size: int = 512) -> Sequences:
    return Sequences(split, size)


def pad(items: list[tuple[list[int], int]]) -> dict[str, torch.Tensor]:
    """Pad a batch to its own longest sequence (not the dataset's)."""
    longest = max(len(t) for t, _ in items)
    ids = torch.full((len(items), longest), PAD, dtype=torch.long)
    mask = torch.zeros((len(items), longest), dtype=torch.long)
    for row, (tokens, _) in enumerate(items):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([y for _, y in items])}


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    return model(**batch).loss


def evaluate(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A new torchmetrics object per batch: redgrain merges them over the split."""
    preds = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    f1, acc = BinaryF1Score(), BinaryAccuracy()
    f1.update(preds, batch["labels"])
    acc.update(preds, batch["labels"])
    return {"f1": f1, "accuracy": acc, "loss": float(model(**batch).loss)}
