"""An optimizer's state by parameter name: what a checkpoint holds, whatever layout saved it.

``torch.optim.Optimizer.state_dict()`` numbers parameters by their position in
the optimizer's groups, group after group: with parameter groups (AdamW's
no-decay biases first) that position is neither the model's order nor the
same in two layouts (a shard holding half the model, an all-reduce rank
holding all of it). A checkpoint restored by position into another layout
then paired state with the wrong parameters or refused the groups
(``ValueError: loaded state dict contains a parameter group that doesn't
match``). So a snapshot keeps the optimizer by name::

    {"state": {name: {"exp_avg": ..., "step": ...}},
     "param_groups": [{"lr": ..., "rg_group": 0, ..., "params": [name, ...]}]}

and each holder turns it into its own optimizer's numbering when it loads
(:func:`load_optimizer_state`). Group membership is the job's (the spec's
globs decide it when a holder builds its optimizer); a group's settings are
those of the saved group its parameters were in.

Checkpoints written before names were used hold positions (``params`` lists
of ints); a holder of the same layout loads them as torch does, and
:func:`named_state` reads them by the part's model order (exact without
parameter groups, which is all such a checkpoint could restore into another
layout anyway; with groups it is refused, naming why).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from silo.errors import ConfigError


def _cpu(v: Any) -> Any:
    return v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v


def _position_names(opt: torch.optim.Optimizer, named: Sequence[tuple[str, nn.Parameter]]) -> list[str]:
    """The parameter names in the numbering of ``opt.state_dict()`` (group after group)."""
    name_of = {id(p): n for n, p in named}
    return [name_of[id(p)] for g in opt.param_groups for p in g["params"]]


def optimizer_state(opt: torch.optim.Optimizer | None, named: Sequence[tuple[str, nn.Parameter]]) -> dict[str, Any]:
    """``opt``'s state and groups keyed by the names of ``named`` (its parameters), CPU copies;
    ``{}`` without an optimizer."""
    if opt is None:
        return {}
    sd = opt.state_dict()
    names = _position_names(opt, named)
    state = {names[int(i)]: {k: _cpu(v) for k, v in s.items()} for i, s in sd["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def is_by_name(saved: dict[str, Any]) -> bool:
    """Whether ``saved`` keys parameters by name (False: by position, a checkpoint of before)."""
    return all(isinstance(n, str) for g in saved.get("param_groups", []) for n in g["params"])


def named_state(saved: dict[str, Any], order: Sequence[str]) -> dict[str, Any]:
    """``saved`` by name; a positional one read with ``order`` (its holder's parameters, model order)."""
    if not saved or is_by_name(saved):
        return saved
    if len(saved.get("param_groups", [])) > 1:
        # Positions run group after group, and which parameters a group held is not recorded.
        raise ConfigError(
            "this checkpoint was written before optimizer state was kept by parameter name, with parameter"
            " groups: it restores only into the layout that saved it (same mode and shard count)"
        )
    own = saved.get("state", {})
    state = {order[int(i)]: s for i, s in own.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [order[int(i)] for i in g["params"]]} for g in saved["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_optimizer_state(opt: torch.optim.Optimizer | None, named: Sequence[tuple[str, nn.Parameter]], saved: dict[str, Any]) -> None:
    """Load ``saved`` (by name; ``{}``: nothing yet) into ``opt`` over ``named``: each parameter
    gets its own state, each group the settings of the saved group that held its parameters.

    ConfigError when a parameter has no saved group (it was frozen, or absent, when the
    checkpoint was taken) or a group's parameters were in saved groups of different settings
    (the job's ``param_groups`` changed since).
    """
    if opt is None or not saved:
        return
    if not is_by_name(saved):
        opt.load_state_dict(saved)  # a positional checkpoint of this very layout
        return
    names = _position_names(opt, named)
    holder: dict[str, dict[str, Any]] = {}
    for g in saved["param_groups"]:
        for n in g["params"]:
            holder[n] = g
    sd = opt.state_dict()
    groups = []
    for g in sd["param_groups"]:
        members = [names[i] for i in g["params"]]
        lost = [n for n in members if n not in holder]
        if lost:
            raise ConfigError(f"the checkpoint holds no optimizer group for parameters {lost[:5]}")
        settings = [{k: v for k, v in holder[n].items() if k not in ("params", "rg_group")} for n in members]
        if any(s != settings[0] for s in settings):
            raise ConfigError(
                f"parameters {members[:5]} were in parameter groups of different settings when the checkpoint was"
                " taken: param_groups changed since; resume with the groups it was saved with"
            )
        groups.append({**g, **settings[0], "params": g["params"]})
    state = {i: saved["state"][n] for i, n in enumerate(names) if n in saved["state"]}
    opt.load_state_dict({"state": state, "param_groups": groups})
