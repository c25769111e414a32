"""Reading a saved ``state_dict`` (``init_from``, fine-tuning) without unpickling arbitrary objects."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from silo.errors import ConfigError


def read_init(path: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of a ``torch.save``\\ d state_dict, checked to fit ``model`` strictly.

    ``weights_only=True``: torch's restricted unpickler, which loads tensors and
    plain containers and refuses code, so a weights file cannot run anything.
    """
    try:
        sd: Any = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError) as exc:
        raise ConfigError(f"init_from {path!r}: cannot read a saved state_dict: {exc}") from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise ConfigError(f"init_from {path!r} holds {type(sd).__name__}, not a state_dict of tensors")
    want = model.state_dict()
    missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    if missing or unexpected:
        raise ConfigError(f"init_from {path!r} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for k, v in want.items():
        if tuple(sd[k].shape) != tuple(v.shape):
            raise ConfigError(f"init_from {path!r}: {k} has shape {tuple(sd[k].shape)}, the model's is {tuple(v.shape)}")
    return sd
