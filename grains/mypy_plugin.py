"""A mypy plugin that types grain references as their grain's remote interface.

``get_grain(Counter, key)`` is typed ``Ref[Counter]`` (grains/ref.py). Python's type system
cannot say "the async methods of G, as awaitables", so ``Ref`` declares a ``__getattr__``
for mypy only, and this plugin answers every attribute mypy resolves through it
(``grains.ref.Ref.<name>``): with G's method bound to the grain, with its own parameters and
its ``Coroutine[Any, Any, R]`` result, or with an ``attr-defined`` error when the name is not
remote. Which names are remote is asked of :func:`grains.ref.never_remote`, the rule the
run-time reference classes are built by, so the two cannot drift apart. Nothing is
synthesised.

A decorated method is remote when what its decorators make of it is still an ``async def``
(at run time: a coroutine or async-generator function, :func:`grains.ref.public_methods`). Its
type cannot say so (a plain function returning a coroutine has the same type), so each
decorator's own signature is read instead: one typed ``(f: F) -> F`` (a TypeVar over the
whole function, as ``@one_way`` and ``@read_only`` are) hands back what it was given; one
whose result is declared ``Callable[P, Awaitable[R]]`` or ``Coroutine[...]`` wraps it in an
``async def`` (``AsyncIterator[T]``: in an async generator); any other result, above all
``Callable[P, R]`` with R the wrapped function's own result, is a plain ``def`` wrapper, not
remote. An untyped decorator is taken at its word as mypy takes it (Any). mypy's cache keeps
no decorators, so a base-class hook records them (by name) in the grain class's metadata when
its module is analysed; a grain read from the cache is judged by that record.

Enable it in the project's mypy configuration::

    [tool.mypy]
    plugins = ["grains.mypy_plugin"]

A ``@one_way`` method returns ``None`` to its caller whatever it declares, and is typed so. A
method written as an async generator (``async def m(self) -> AsyncIterator[T]: ... yield``) is
remote too; its call is iterated, not awaited, and is typed as what the reference returns,
:class:`grains.result_stream.ResultStream` ``[T]`` (an ``AsyncIterator[T]`` with ``aclose``).
Where G is not known (``Ref[Any]``), the attribute keeps ``Ref.__getattr__``'s type: any
arguments, an awaitable of ``Any`` (as a by-name ``GrainRef`` is typed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

from mypy.errorcodes import ATTR_DEFINED
from mypy.expandtype import expand_type_by_instance
from mypy.maptype import map_instance_to_supertype
from mypy.messages import format_type_bare
from mypy.nodes import (
    ARG_STAR,
    ARG_STAR2,
    CallExpr,
    Decorator,
    Expression,
    FuncDef,
    OverloadedFuncDef,
    RefExpr,
    TypeInfo,
    Var,
)
from mypy.plugin import AttributeContext, ClassDefContext, Plugin
from mypy.typeops import bind_self, function_type
from mypy.types import (
    AnyType,
    CallableType,
    FunctionLike,
    Instance,
    NoneType,
    Overloaded,
    Type,
    TypeOfAny,
    TypeVarType,
    get_proper_type,
)

from grains.ref import never_remote

REF = "grains.ref.Ref"
# Looked up through the package, which re-exports it: mypy loads a package with any of its
# modules (grains.ref among them), not a submodule no one imports by name.
RESULT_STREAM = "grains.ResultStream"
ONE_WAY = "grains.placement.one_way"
GRAIN = "grains.base.Grain"
METADATA = "grains.mypy_plugin"
# Class decorators that hand back a function of the kind they were given.
KEEPS_KIND = frozenset({"builtins.staticmethod", "builtins.classmethod"})

Kind = Literal["coroutine", "generator", "plain"]
"""What a grain method is at run time: an ``async def``, an async generator, or neither."""

Decorated = tuple[str, str]
"""A decorator as recorded: ("ref", its full name) for ``@deco``, ("call", the factory's) for
``@deco(...)``, ("other", "") for an expression of another shape."""


class GrainsPlugin(Plugin):
    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        owner, _, name = fullname.rpartition(".")
        if owner != REF:
            return None
        return functools.partial(_remote_attribute, self, name)

    def get_base_class_hook(self, fullname: str) -> Callable[[ClassDefContext], None] | None:
        sym = self.lookup_fully_qualified(fullname)
        if sym is not None and isinstance(sym.node, TypeInfo) and any(b.fullname == GRAIN for b in sym.node.mro):
            return _record_decorators
        return None

    def kind_after(self, func: FuncDef, decorators: Sequence[Decorated]) -> tuple[Kind, str]:
        """What ``func`` is once its decorators (outermost first) are applied, and the name of
        the last one that made it a plain function ("" if none did)."""
        kind: Kind = "generator" if func.is_async_generator else "coroutine" if func.is_coroutine else "plain"
        culprit = ""
        for how, fullname in reversed(decorators):  # applied bottom-up
            after = self._decorated(kind, how, fullname)
            if after == "plain" and kind != "plain":
                culprit = fullname
            kind = after
        return kind, culprit

    def _decorated(self, kind: Kind, how: str, fullname: str) -> Kind:
        if fullname in KEEPS_KIND:
            return kind
        sym = self.lookup_fully_qualified(fullname) if fullname else None
        node = sym.node if sym is not None else None
        if isinstance(node, TypeInfo):
            return "plain" if how == "ref" else kind  # an instance of a class: not a function
        typ = node.type if isinstance(node, (FuncDef, OverloadedFuncDef, Var)) else None
        if isinstance(node, Decorator):
            typ = node.var.type
        typ = get_proper_type(typ)
        if how == "call":  # a factory: the decorator is what it returns
            typ = get_proper_type(typ.ret_type) if isinstance(typ, CallableType) else None
        if not isinstance(typ, CallableType):
            return kind  # untyped, overloaded or unknown: as mypy sees it
        return _result_kind(typ, kind)


def plugin(version: str) -> type[Plugin]:
    return GrainsPlugin


def _record_decorators(ctx: ClassDefContext) -> None:
    """Keep each method's decorators in the class's metadata, which mypy's cache keeps."""
    recorded: dict[str, list[Decorated]] = {}
    for stmt in ctx.cls.defs.body:
        if isinstance(stmt, Decorator):
            recorded[stmt.name] = [_describe(d) for d in stmt.original_decorators]
    ctx.cls.info.metadata[METADATA] = {"decorators": recorded}


def _describe(expr: Expression) -> Decorated:
    if isinstance(expr, RefExpr) and expr.fullname:
        return ("ref", expr.fullname)
    if isinstance(expr, CallExpr) and isinstance(expr.callee, RefExpr) and expr.callee.fullname:
        return ("call", expr.callee.fullname)
    return ("other", "")


def _result_kind(decorator: CallableType, kind: Kind) -> Kind:
    """What a function of ``kind`` is after ``decorator``, by the decorator's signature."""
    ret = get_proper_type(decorator.ret_type)
    if isinstance(ret, (AnyType, Overloaded)):
        return kind
    if isinstance(ret, TypeVarType):
        # (f: F) -> F: the function it was given, or one of its kind.
        return kind
    if not isinstance(ret, CallableType):
        return "plain"  # an object (a descriptor, a callable class): no async def
    result = get_proper_type(ret.ret_type)
    if isinstance(result, AnyType):
        return kind
    if isinstance(result, Instance):
        bases = {b.fullname for b in result.type.mro}
        if "typing.AsyncIterator" in bases or "typing.AsyncIterable" in bases:
            return "generator"
        if "typing.Awaitable" in bases:
            return "coroutine"
    # Callable[P, R] with R the wrapped function's result, or any other result: a plain def
    # returns it (a coroutine object, unawaited, if that is what the wrapped one returns).
    return "plain"


def _remote_attribute(plugin: GrainsPlugin, name: str, ctx: AttributeContext) -> Type:
    grain = _grain_of(ctx.type)
    if grain is None:
        return ctx.default_attr_type
    missing = f'Reference to "{format_type_bare(grain, ctx.api.options)}" has no attribute "{name}"'
    if name.startswith("_"):
        return _fail(ctx, f"{missing} (private: only public async methods are remote)")
    if never_remote(name):
        return _fail(ctx, f"{missing} (a Grain helper or lifecycle hook, not a remote method)")
    sym = grain.type.get(name)
    node = sym.node if sym is not None else None
    if node is None:
        return _fail(ctx, missing)
    found = _async_method(plugin, node, ctx)
    if isinstance(found, str):
        made = f'decorator "{found.rpartition(".")[2]}" makes it a plain function; ' if found else ""
        return _fail(ctx, f"{missing} (not an async method: {made}only public async methods are remote)")
    typ = found.signature
    if found.binds_self:
        typ = bind_self(typ, grain, is_classmethod=found.classmethod)
    bound = get_proper_type(expand_type_by_instance(typ, map_instance_to_supertype(grain, found.owner)))
    if found.stream and isinstance(bound, CallableType):
        # The reference returns its ResultStream[T] at once (grains/ref.py), T the item type.
        declared = get_proper_type(bound.ret_type)
        item: Type = AnyType(TypeOfAny.implementation_artifact)
        if isinstance(declared, Instance) and declared.args:
            item = declared.args[0]
        bound = bound.copy_modified(ret_type=ctx.api.named_generic_type(RESULT_STREAM, [item]))
    elif found.one_way and isinstance(bound, CallableType):
        # The caller's await ends once the message is sent, with None (grains/placement.py).
        any_ = AnyType(TypeOfAny.implementation_artifact)
        bound = bound.copy_modified(
            ret_type=ctx.api.named_generic_type("typing.Coroutine", [any_, any_, NoneType()])
        )
    return bound


def _grain_of(typ: Type) -> Instance | None:
    """The grain instance type G of a ``Ref[G]`` (or of a subclass of Ref), if it is known."""
    typ = get_proper_type(typ)
    if not isinstance(typ, Instance):
        return None
    ref_info = next((base for base in typ.type.mro if base.fullname == REF), None)
    if ref_info is None:
        return None
    ref = map_instance_to_supertype(typ, ref_info)
    if not ref.args:
        return None
    grain = get_proper_type(ref.args[0])
    if isinstance(grain, TypeVarType):  # generic code: what the bound promises
        grain = get_proper_type(grain.upper_bound)
    return grain if isinstance(grain, Instance) else None


class _Method(NamedTuple):
    """What a reference needs of one of the grain's ``async def`` methods."""

    signature: FunctionLike
    owner: TypeInfo
    binds_self: bool
    classmethod: bool
    one_way: bool
    stream: bool = False


def _async_method(plugin: GrainsPlugin, node: object, ctx: AttributeContext) -> _Method | str:
    """The grain's method ``node``, if it is an ``async def`` (a coroutine or an async generator,
    not a property) once decorated; else the full name of the decorator that made it a plain
    function, or "" (it was none, or is no function)."""
    decorators: Sequence[Decorated] = ()
    if isinstance(node, Decorator):
        func, typ = node.func, node.var.type or node.func.type
        decorators = _decorators(node)
    elif isinstance(node, FuncDef):
        func, typ = node, node.type
    elif isinstance(node, OverloadedFuncDef):
        first = node.impl or (node.items[0] if node.items else None)
        if first is None:
            return ""
        func = first.func if isinstance(first, Decorator) else first
        typ = node.type
    else:  # a variable, a nested class: never remote
        return ""
    if func.is_property:
        return ""
    kind, culprit = plugin.kind_after(func, decorators)
    if kind == "plain":
        return culprit
    function = ctx.api.named_generic_type("builtins.function", [])
    if typ is None:  # an unannotated def: any arguments, result Any
        typ = function_type(func, function)
    proper = get_proper_type(typ)
    if isinstance(proper, AnyType):  # behind an untyped decorator: Any, as mypy sees the grain's own
        anything = CallableType([proper, proper], [ARG_STAR, ARG_STAR2], [None, None], proper, function)
        return _Method(anything, func.info, binds_self=False, classmethod=False, one_way=False)
    if not isinstance(proper, FunctionLike):  # a decorator made it something else
        return ""
    one_way = ("ref", ONE_WAY) in decorators
    return _Method(proper, func.info, not func.is_static, func.is_class, one_way, kind == "generator")


def _decorators(node: Decorator) -> list[Decorated]:
    """A decorated method's decorators, outermost first: from the tree when its module was
    analysed in this run, else (read from mypy's cache, which keeps none) as recorded."""
    if node.original_decorators:
        return [_describe(d) for d in node.original_decorators]
    recorded = node.func.info.metadata.get(METADATA, {}).get("decorators", {}).get(node.name, [])
    return [(str(how), str(name)) for how, name in recorded]


def _fail(ctx: AttributeContext, message: str) -> Type:
    ctx.api.fail(message, ctx.context, code=ATTR_DEFINED)
    return AnyType(TypeOfAny.from_error)
