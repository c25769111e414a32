"""A mypy plugin that types grain references as their grain's remote interface.

``get_grain(Counter, key)`` is typed ``Ref[Counter]`` (grains/ref.py). Python's type system
cannot say "the async methods of G, as awaitables", so ``Ref`` declares a ``__getattr__``
for mypy only, and this plugin answers every attribute mypy resolves through it
(``grains.ref.Ref.<name>``): with G's method bound to the grain, with its own parameters and
its ``Coroutine[Any, Any, R]`` result, or with an ``attr-defined`` error when the name is not
remote. Which names are remote is asked of :func:`grains.ref.never_remote`, the rule the
run-time reference classes are built by, so the two cannot drift apart. Nothing is
synthesised, so mypy's cache and grains defined in other modules need nothing special.

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
from typing import NamedTuple

from mypy.errorcodes import ATTR_DEFINED
from mypy.expandtype import expand_type_by_instance
from mypy.maptype import map_instance_to_supertype
from mypy.messages import format_type_bare
from mypy.nodes import (
    ARG_STAR,
    ARG_STAR2,
    Decorator,
    FuncDef,
    OverloadedFuncDef,
    RefExpr,
    TypeInfo,
)
from mypy.plugin import AttributeContext, Plugin
from mypy.typeops import bind_self, function_type
from mypy.types import (
    AnyType,
    CallableType,
    FunctionLike,
    Instance,
    NoneType,
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


class GrainsPlugin(Plugin):
    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        owner, _, name = fullname.rpartition(".")
        if owner != REF:
            return None
        return functools.partial(_remote_attribute, name)


def plugin(version: str) -> type[Plugin]:
    return GrainsPlugin


def _remote_attribute(name: str, ctx: AttributeContext) -> Type:
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
    found = _async_method(node, ctx)
    if found is None:
        return _fail(ctx, f"{missing} (not an async method: only public async methods are remote)")
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


def _async_method(node: object, ctx: AttributeContext) -> _Method | None:
    """The grain's method ``node``, if it is an ``async def`` (a coroutine or an async generator,
    not a property)."""
    decorators: Sequence[object] = ()
    if isinstance(node, Decorator):
        func, typ, decorators = node.func, node.var.type or node.func.type, node.original_decorators
    elif isinstance(node, FuncDef):
        func, typ = node, node.type
    elif isinstance(node, OverloadedFuncDef):
        first = node.impl or (node.items[0] if node.items else None)
        if first is None:
            return None
        func = first.func if isinstance(first, Decorator) else first
        typ = node.type
    else:  # a variable, a nested class: never remote
        return None
    if not (func.is_coroutine or func.is_async_generator) or func.is_property:
        return None
    function = ctx.api.named_generic_type("builtins.function", [])
    if typ is None:  # an unannotated def: any arguments, result Any
        typ = function_type(func, function)
    proper = get_proper_type(typ)
    if isinstance(proper, AnyType):  # behind an untyped decorator: Any, as mypy sees the grain's own
        anything = CallableType([proper, proper], [ARG_STAR, ARG_STAR2], [None, None], proper, function)
        return _Method(anything, func.info, binds_self=False, classmethod=False, one_way=False)
    if not isinstance(proper, FunctionLike):  # a decorator made it something else
        return None
    one_way = any(isinstance(d, RefExpr) and d.fullname == ONE_WAY for d in decorators)
    return _Method(proper, func.info, not func.is_static, func.is_class, one_way, func.is_async_generator)


def _fail(ctx: AttributeContext, message: str) -> Type:
    ctx.api.fail(message, ctx.context, code=ATTR_DEFINED)
    return AnyType(TypeOfAny.from_error)
