"""``@immutable``: values a call may pass by reference, because nobody changes them.

Every call's arguments and result are the callee's and the caller's own: across
silos they travel encoded, and on the caller's own silo they are copied
through the same codec rules (:meth:`silo.codec.Codec.copy`), so a callee that
appends to a list argument never changes the caller's list, wherever it runs.
That copy is what Orleans does too; its ``[Immutable]`` skips it, and so does
this marker:

- on a class (a pydantic model, dataclass or Enum registered for the wire):
  its instances are passed by reference to a grain on the same silo;
- on a ``torch.Tensor`` or ``numpy.ndarray`` value, ``immutable(t)`` marks
  that one tensor (a numpy array is made read-only, ``flags.writeable =
  False``; a tensor keeps an attribute, torch having no read-only flag) and
  returns it: a 1 GB weight tensor handed to a grain beside it is not copied.

It is a promise, not a guard: neither side may change a marked value after
the call (on the same silo both would see the change). Across silos the
marker changes nothing: the value is encoded as always, and the receiver's
copy is not marked.
"""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T")

MARK = "__redgrain_immutable__"
"""The attribute that marks a class (in its own ``__dict__``: subclasses are not marked) or a tensor."""


_TENSOR_TYPES: set[type] = set()
"""torch's tensor classes once seen (this module does not import torch)."""


def immutable(obj: T) -> T:
    """Mark a class or a tensor/array as passed by reference on the same silo (see the module doc)."""
    if isinstance(obj, type):
        setattr(obj, MARK, True)
        return obj  # type: ignore[return-value]
    if type(obj) in _TENSOR_TYPES:  # a step marks every tensor it sends: no name built for them
        setattr(obj, MARK, True)
        return obj
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if kind == "numpy.ndarray":
        obj.flags.writeable = False  # type: ignore[attr-defined]
        return obj
    if kind in ("torch.Tensor", "torch.nn.parameter.Parameter"):
        _TENSOR_TYPES.add(type(obj))
        setattr(obj, MARK, True)
        return obj
    raise TypeError(f"immutable() marks a class, a torch.Tensor or a numpy.ndarray, not a {kind}")


def is_immutable(value: Any) -> bool:
    """Whether ``value`` is marked (its class, or the tensor itself; a read-only numpy array)."""
    t = type(value)
    if t.__dict__.get(MARK):
        return True
    # The instance's own mark first: asking a tensor for ``flags`` raises (and catches) an
    # AttributeError, a microsecond per tensor of a push.
    d = getattr(value, "__dict__", None)
    if d and d.get(MARK):
        return True
    if t.__module__ == "numpy":
        flags = getattr(value, "flags", None)
        return flags is not None and not flags.writeable
    return False
