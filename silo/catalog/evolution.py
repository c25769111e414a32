"""Loading a stored state into the grain's current ``State`` model, whatever version wrote it.

A state is stored as its field map, and every model nested in it as its
field map too (the codec's ``decode_fields``: the stored value is read
without building any class by name). The current model then validates the
whole tree, so at every nesting level:

* a field added since takes its default;
* a field renamed since keeps its value through a declared alias
  (``Field(validation_alias=AliasChoices("new", "old"))``, pydantic's own);
  the field's own name is always accepted too (``by_name``), and where both
  are stored (an older version kept the new name unread and wrote its old
  one beside it) the field's own name wins, whatever the alias order says;
* a nested class renamed since loads: the field's annotation, not the name
  the value was written under, says what it becomes;
* a value that no longer fits its field fails with a StorageError naming
  the field's path (``address.zip``), never a silent default.

Nothing is dropped: a stored field the model does not have (no field, no
alias: written by a newer version, or removed since) is kept as it was
stored, in the model's ``__pydantic_extra__``, and written back unchanged by
the next write (the codec writes a model's extras beside its fields), as
protobuf keeps unknown fields. So in a rolling upgrade an old silo that
serves a write of a grain a new one wrote keeps the new version's fields.
It is logged once per grain type and field path (items of a list or map
share one path, ``places[].fax``), at INFO. The values stay invisible to
``model_dump``; they go only with the object that holds them (a model
replaced by a new one starts without them; the state's top level is the
exception, see StateHandle.encode). A model that says ``extra="ignore"``
itself drops them (logged once at WARNING, as its value goes with the next
write); ``extra="allow"`` keeps them as pydantic does, logging nothing; a
nested dataclass has nowhere to keep them, so it drops them (WARNING).

A value in a field typed ``Any`` (or any annotation that takes a dict as it
is) is the one place no schema says what a nested value is: there it is
built from the registered name it was written under, as before.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pydantic import AliasChoices, AliasPath, BaseModel, ValidationError

from silo import errors
from silo.codec import Codec, StoredObject

log = logging.getLogger("redgrain.state")

_LEAVES = (str, int, float, bool, bytes, type(None))


class StateLoader:
    """Builds State models from stored trees for one silo; remembers what it has logged."""

    def __init__(self, codec: Codec) -> None:
        self._codec = codec
        self._logged: set[tuple[str, str]] = set()
        """(grain type, field path) of dropped fields already logged."""

    def load(self, model: type[BaseModel], tree: Any, *, grain: str, type_name: str) -> BaseModel:
        """``tree`` (from ``Codec.decode_fields``) as ``model``; StorageError if it does not fit."""
        if not isinstance(tree, dict):
            raise errors.StorageError(
                f"stored state of {grain} is a {type(tree).__name__}, not a {model.__qualname__}"
            )
        try:
            value = model.model_validate(tree, by_name=True)
        except ValidationError as exc:
            raise misfit(grain, model, exc) from exc
        dropped: list[str] = []
        kept: list[str] = []
        value = self._settle(value, tree, "", dropped, kept)
        for path in dict.fromkeys(dropped):
            if (type_name, path) not in self._logged:
                self._logged.add((type_name, path))
                log.warning(
                    "grain type %s: stored state field %r is not in %s any more (no field, no alias); "
                    "its value is dropped at the next write. Declare it again, or alias it from its new "
                    "name (docs/state.md, Schema evolution)",
                    type_name, path, model.__qualname__,
                )
        for path in dict.fromkeys(kept):
            if (type_name, path) not in self._logged:
                self._logged.add((type_name, path))
                log.info(
                    "grain type %s: stored state field %r is not in %s (a newer version's, or removed); "
                    "kept, and written back unchanged (docs/state.md, Schema evolution)",
                    type_name, path, model.__qualname__,
                )
        return value  # type: ignore[no-any-return]

    def _settle(self, value: Any, stored: Any, path: str, dropped: list[str], kept: list[str]) -> Any:
        """Walk the validated ``value`` beside the ``stored`` tree it came from: keep (or note as
        dropped) stored fields no model took, build what a schema-less field kept as a
        StoredObject. Returns ``value`` (or what replaces it)."""
        if type(value) is StoredObject:
            # Kept as it is by an annotation that takes any dict (Any): build it by its name.
            try:
                return self._codec.build(value)
            except errors.CodecError:
                return _plain(value)  # its class is gone: the fields, as plain maps
        if isinstance(value, BaseModel) and isinstance(stored, dict):
            fields = type(value).model_fields
            taken: set[str] = set()
            for name, info in fields.items():
                key = _source_key(name, info.validation_alias, info.alias, stored)
                taken.update(_accepted(name, info.validation_alias, info.alias))
                if key is not None and key != name and name in stored:
                    # Both the field's name and an old one it is aliased from are stored: an older
                    # version wrote the old name back beside the new one it kept unread. The new
                    # name holds what this version wrote; pydantic took the alias first.
                    try:
                        type(value).__pydantic_validator__.validate_assignment(value, name, stored[name])
                        key = name
                    except ValidationError:
                        pass  # (a frozen model) the alias's value stays
                if key is not None and key in stored:
                    child = getattr(value, name)
                    settled = self._settle(child, stored[key], _join(path, name), dropped, kept)
                    if settled is not child:
                        value.__dict__[name] = settled
            extra = value.__pydantic_extra__
            if extra is not None:  # extra="allow": kept, so not dropped; settled like fields
                for k in extra.keys() & stored.keys():
                    extra[k] = self._settle(extra[k], stored[k], _join(path, str(k)), dropped, kept)
            elif type(value).model_config.get("extra") == "ignore":  # said so itself: dropped
                dropped.extend(_join(path, str(k)) for k in stored if k not in taken)
            else:
                # Unknown to this version: kept as stored (StoredObjects keep their wire names),
                # where the codec writes a model's extras back; invisible to model_dump.
                unknown = {k: v for k, v in stored.items() if k not in taken}
                if unknown:
                    object.__setattr__(value, "__pydantic_extra__", unknown)
                    kept.extend(_join(path, str(k)) for k in unknown)
            return value
        if dataclasses.is_dataclass(value) and not isinstance(value, type) and isinstance(stored, dict):
            names = {f.name for f in dataclasses.fields(value)}
            for name in names & set(stored):
                child = getattr(value, name)
                settled = self._settle(child, stored[name], _join(path, name), dropped, kept)
                if settled is not child:
                    object.__setattr__(value, name, settled)
            dropped.extend(_join(path, str(k)) for k in stored if k not in names)
            return value
        if isinstance(value, list) and isinstance(stored, (list, tuple)) and len(value) == len(stored):
            if any(not isinstance(s, _LEAVES) for s in stored):
                for i, (child, s) in enumerate(zip(value, stored, strict=True)):
                    settled = self._settle(child, s, f"{path}[]", dropped, kept)
                    if settled is not child:
                        value[i] = settled
            return value
        if isinstance(value, tuple) and isinstance(stored, (list, tuple)) and len(value) == len(stored):
            items = [self._settle(c, s, f"{path}[]", dropped, kept) for c, s in zip(value, stored, strict=True)]
            return value if all(a is b for a, b in zip(items, value, strict=True)) else type(value)(items)
        if isinstance(value, dict) and isinstance(stored, dict):
            for k in value.keys() & stored.keys():
                child = value[k]
                settled = self._settle(child, stored[k], f"{path}[]", dropped, kept)
                if settled is not child:
                    value[k] = settled
        return value


def _plain(value: Any) -> Any:
    """``value`` with every StoredObject in it a plain dict."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _accepted(name: str, validation_alias: Any, alias: str | None) -> set[str]:
    """The stored keys a field takes its value from: its name, its alias, its alias choices."""
    out = {name}
    if alias:
        out.add(alias)
    for choice in _choices(validation_alias):
        if isinstance(choice, str):
            out.add(choice)
        elif isinstance(choice, AliasPath) and choice.path and isinstance(choice.path[0], str):
            out.add(choice.path[0])
    return out


def _source_key(name: str, validation_alias: Any, alias: str | None, stored: dict[Any, Any]) -> str | None:
    """The stored key the field's value came from, in pydantic's order: aliases, then the name."""
    for choice in [*_choices(validation_alias), alias, name]:
        if isinstance(choice, str) and choice in stored:
            return choice
    return None


def _choices(validation_alias: Any) -> list[Any]:
    if validation_alias is None:
        return []
    if isinstance(validation_alias, AliasChoices):
        return list(validation_alias.choices)
    return [validation_alias]


def misfit(grain: str, model: type[BaseModel], exc: ValidationError) -> errors.StorageError:
    """The StorageError for a stored state that does not validate: every field path and why."""
    problems = []
    for e in exc.errors():
        field = ".".join(str(p) for p in e.get("loc", ())) or "(root)"
        problems.append(f"field {field!r}: {e.get('msg')} (stored value {e.get('input')!r:.80})")
    return errors.StorageError(
        f"stored state of grain {grain} does not fit {model.__qualname__}: " + "; ".join(problems)
    )
