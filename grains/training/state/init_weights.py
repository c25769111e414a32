"""Reading a saved ``state_dict`` (``init_from``, fine-tuning) without unpickling arbitrary objects.

The file is a ``state_dict`` (``torch.save(model.state_dict(), path)``), or, with
``init_optimizer = true``, torch's usual checkpoint dict ``{"model": model.state_dict(),
"optimizer": optimizer.state_dict()}`` of a plain loop whose optimizer was built over
``model.parameters()`` (all of them, or the trainable ones, in model order): its per-parameter
state (momentum, Adam's moments and step count) is carried into the job, its hyperparameters
are the job's own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from silo.errors import ConfigError


def _load(path: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError) as exc:
        raise ConfigError(f"init_from {path!r}: cannot read a saved state_dict: {exc}") from None


def read_init_optimizer(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Load the per-parameter state of the checkpoint's ``"optimizer"`` into ``opt`` (the job's
    optimizer over ``model``'s trainable parameters): state matched to parameters by their
    position in ``model.parameters()``."""
    data = _load(path)
    saved = data.get("optimizer") if isinstance(data, dict) else None
    if not isinstance(saved, dict) or "state" not in saved or "param_groups" not in saved:
        raise ConfigError(f"init_from {path!r}: init_optimizer needs {{'model': ..., 'optimizer': optimizer.state_dict()}}")
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    every = list(model.named_parameters())
    trainable = [(n, p) for n, p in every if p.requires_grad]
    over = every if len(ids) == len(every) else trainable if len(ids) == len(trainable) else None
    if over is None:
        raise ConfigError(
            f"init_from {path!r}: the saved optimizer holds {len(ids)} parameters; the model has {len(every)}"
            f" ({len(trainable)} trainable): build the optimizer over model.parameters()"
        )
    by_name = {n: p for n, p in trainable}
    for position, i in enumerate(sorted(ids)):
        name, _ = over[position]
        state = saved["state"].get(i, saved["state"].get(str(i)))
        if state is None or name not in by_name:
            continue
        p = by_name[name]
        opt.state[p] = {k: (v.to(p.device).clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def read_init(path: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of a ``torch.save``\\ d state_dict, checked to fit ``model`` strictly.

    ``weights_only=True``: torch's restricted unpickler, which loads tensors and
    plain containers and refuses code, so a weights file cannot run anything.
    """
    sd: Any = _load(path)
    if isinstance(sd, dict) and isinstance(sd.get("model"), dict) and "optimizer" in sd:
        sd = sd["model"]  # torch's usual checkpoint dict
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
