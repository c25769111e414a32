"""Cutting any module at named submodules (``split_points``) into pipeline stages, with torch.fx.

A job names the submodules where a new stage *begins* (``split_points =
["blocks.2", "head"]``: three stages), as ``torch.distributed.pipelining``'s
``SplitPoint.BEGINNING`` does. The model's ``forward`` is traced once with
``torch.fx`` (symbolically: no tensor is computed, so it works on a model
built on the meta device), and its nodes are numbered in execution order:
a node belongs to stage ``k`` once the forward has entered the ``k``-th
split point's module. Each stage becomes an ``fx.GraphModule`` over the
original model that holds only the submodules and attributes its nodes use,
under their original names (``"blocks.2.fc.weight"``), so checkpoints,
parameter groups and the exported ``state_dict`` read as in every other mode.

Why not ``torch.fx.passes.split_module``: it renames submodules
(``blocks_2_fc``) and hoists a parameter read outside a leaf module
(``get_attr``) into the parent graph, which would then pass the parameter to
the stage as an input; a stage grain must own its parameters. Why not
``torch.distributed.pipelining.pipeline(split_spec=...)``: it traces with
``torch.export`` on example inputs (real tensors, the whole model in memory)
and its stage modules are meant for its own runtime; see
docs/decisions.md §24.

What the cut requires (all checked at submit, ConfigError saying which):

- every split point names a submodule (``model.get_submodule``) that the
  forward reaches, in the order the forward reaches them; no stage is empty;
- the model is traceable by ``torch.fx`` (no Python control flow on tensor
  values) and takes one input;
- exactly **one value crosses each cut** (the stage's output is the next
  stage's only input: the wire carries one tensor per micro-batch), and the
  model returns one value, computed by the last stage: cut a residual
  network between blocks, not inside one;
- no parameter or buffer is used by two stages (tied weights would be two
  copies trained apart), and every one is used by some stage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx, nn

from silo.errors import ConfigError


class _Tracer(fx.Tracer):
    """torch.fx's tracer, entering the modules that contain a split point (torch.nn's
    containers such as ``nn.TransformerEncoder`` are otherwise traced as one call)."""

    def __init__(self, enter: set[str]) -> None:
        super().__init__()
        self.enter = enter

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.enter:
            return False
        return super().is_leaf_module(m, module_qualified_name)


def _inside(node: fx.Node, point: str) -> bool:
    """Whether ``node`` runs inside the module named ``point``."""
    names = list((node.meta.get("nn_module_stack") or {}).keys())
    if node.op in ("call_module", "get_attr"):
        names.append(str(node.target))
    return any(n == point or n.startswith(point + ".") for n in names)


def trace(model: nn.Module, points: Sequence[str]) -> fx.Graph:
    """The model's forward as an fx graph (ConfigError naming the model when it cannot be traced)."""
    modules = dict(model.named_modules())
    for p in points:
        if p not in modules or not p:
            near = [n for n in modules if n and n.split(".")[0] == p.split(".")[0]][:5]
            raise ConfigError(f"split point {p!r}: the model has no submodule of that name" + (f" (it has {near})" if near else ""))
    if len(set(points)) != len(points):
        raise ConfigError(f"split_points {list(points)} name a submodule twice")
    enter = {".".join(p.split(".")[:i]) for p in points for i in range(1, p.count(".") + 1)} | {""}
    try:
        return _Tracer(enter).trace(model)
    except Exception as exc:  # noqa: BLE001 - fx raises TraceError, TypeError, whatever the forward does
        raise ConfigError(
            f"split_points: torch.fx cannot trace {type(model).__name__}.forward ({type(exc).__name__}: {exc});"
            " a cut at split points needs a forward without Python control flow on tensor values"
        ) from None


def _stage_numbers(graph: fx.Graph, points: Sequence[str]) -> dict[fx.Node, int]:
    """Each computing node's stage (``get_attr`` nodes go with the stage that uses them)."""
    stage: dict[fx.Node, int] = {}
    k = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        while k < len(points) and _inside(node, points[k]):
            k += 1
        stage[node] = k
    if k < len(points):
        p = points[k]
        if any(_inside(n, p) for n in graph.nodes):
            raise ConfigError(
                f"split point {p!r} runs before {points[k - 1]!r} in the forward:"
                " list split_points in the order the forward reaches them"
            )
        raise ConfigError(f"split point {p!r}: the forward never calls that submodule")
    for node in graph.nodes:
        if node.op == "get_attr":
            users = {stage[u] for u in node.users if u in stage}
            if len(users) > 1:
                raise ConfigError(f"{node.target!r} is used by stages {sorted(users)}: a tensor can live on one stage only")
            if users:
                stage[node] = users.pop()
    return stage


def split(model: nn.Module, points: Sequence[str]) -> list[fx.GraphModule]:
    """The ``len(points) + 1`` stage modules of ``model`` cut at ``points`` (see the module doc).

    The stage modules share their submodules and tensors with ``model`` (nothing is copied):
    keep the one a stage needs and drop the rest.
    """
    graph = trace(model, points)
    inputs = [n for n in graph.nodes if n.op == "placeholder" and n.users]
    if len(inputs) != 1:
        raise ConfigError(f"pipeline: the model's forward must take one input; it uses {[n.name for n in inputs]}")
    (output,) = [n for n in graph.nodes if n.op == "output"]
    result = output.args[0]
    if not isinstance(result, fx.Node):
        raise ConfigError("pipeline: the model's forward must return one tensor (not a tuple, list or dict)")
    stage = _stage_numbers(graph, points)
    stage[inputs[0]] = -1
    count = len(points) + 1
    members: list[list[fx.Node]] = [[] for _ in range(count)]
    for node in graph.nodes:
        if node in stage and stage[node] >= 0:
            members[stage[node]].append(node)
    for k, nodes in enumerate(members):
        if not any(n.op != "get_attr" for n in nodes):
            where = "before the first split point" if k == 0 else f"from split point {points[k - 1]!r}"
            raise ConfigError(f"pipeline: stage {k} ({where}) would compute nothing: more stages than layers")
    # The value entering each stage: the one node computed before it and used from it on.
    entering: list[fx.Node] = []
    for k in range(count):
        crossing = [
            n for n in graph.nodes
            if n in stage and stage[n] < k and any(u in stage and stage[u] >= k for u in n.users)
        ]  # fmt: skip
        if k == 0:
            crossing = [inputs[0]]
        if len(crossing) != 1:
            raise ConfigError(
                f"pipeline: {len(crossing)} values cross the cut at split point {points[k - 1]!r}"
                f" ({', '.join(n.name for n in crossing)}); a stage passes one tensor on: cut where one value crosses"
                " (between residual blocks, not inside one)"
            )
        if k > 0 and stage[crossing[0]] != k - 1:
            raise ConfigError(f"pipeline: stage {k} needs {crossing[0].name!r} from stage {stage[crossing[0]]}, not from stage {k - 1}")
        entering.append(crossing[0])
    if stage.get(result, -1) != count - 1:
        raise ConfigError("pipeline: the model's output must be computed by the last stage")
    modules = []
    for k in range(count):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {entering[k]: g.placeholder("x")}
        for node in members[k]:
            env[node] = g.node_copy(node, env.__getitem__)
        g.output(env[entering[k + 1]] if k + 1 < count else env[result])
        gm = fx.GraphModule(model, g, class_name=f"Stage{k}")
        _keep_buffer_persistence(model, gm)
        modules.append(gm)
    _check_ownership(model, modules)
    return modules


def _keep_buffer_persistence(model: nn.Module, gm: nn.Module) -> None:
    """fx registers a buffer read by ``get_attr`` as persistent; keep the original's flag."""
    for name, _ in list(gm.named_buffers()):
        owner_name, _, field = name.rpartition(".")
        src = model.get_submodule(owner_name)
        if field in getattr(src, "_non_persistent_buffers_set", set()):
            gm.get_submodule(owner_name)._non_persistent_buffers_set.add(field)


def _check_ownership(model: nn.Module, stages: list[fx.GraphModule]) -> None:
    owner: dict[str, int] = {}
    for k, st in enumerate(stages):
        for name in [*dict(st.named_parameters()), *st.state_dict()]:
            if owner.setdefault(name, k) != k:
                raise ConfigError(f"pipeline: {name!r} is used by stages {owner[name]} and {k} (tied weights cannot be cut apart)")
    unused = [n for n in [*dict(model.named_parameters()), *model.state_dict()] if n not in owner]
    if unused:
        raise ConfigError(f"pipeline: {unused[:5]} are not used by the forward, so no stage would hold them")


def stage_sizes(stages: Sequence[nn.Module]) -> list[int]:
    """Bytes of each stage's parameters and persistent buffers."""
    return [sum(t.numel() * t.element_size() for t in st.state_dict().values()) for st in stages]


def chain(stages: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """Run the stages one after another (as the pipeline does, without the wire); each output must be a tensor."""
    for k, st in enumerate(stages):
        x = st(x)
        if not isinstance(x, torch.Tensor):
            raise ConfigError(f"pipeline: stage {k} returns {type(x).__name__}, not a tensor: a stage passes one tensor on")
    return x
