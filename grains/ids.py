"""Identities: a grain's id and a silo's address. Both frozen, both cheap."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def _key_str(key: str | int | uuid.UUID) -> str:
    if isinstance(key, bool):
        raise TypeError("a grain key may be str, int or UUID, not bool")
    if isinstance(key, (str, int, uuid.UUID)):
        return str(key)
    raise TypeError(f"a grain key may be str, int or UUID, not {type(key).__name__}")


@dataclass(frozen=True, slots=True)
class GrainId:
    """``GrainId(type_name, key)``: valid forever, needs no lookup to make."""

    type_name: str
    key: str

    @classmethod
    def of(cls, type_name: str, key: str | int | uuid.UUID) -> GrainId:
        return cls(type_name, _key_str(key))

    def __str__(self) -> str:
        return f"{self.type_name}/{self.key}"

    @classmethod
    def parse(cls, text: str) -> GrainId:
        type_name, sep, key = text.partition("/")
        if not sep or not type_name:
            raise ValueError(f"not a grain id: {text!r}")
        return cls(type_name, key)


@dataclass(frozen=True, slots=True)
class SiloAddress:
    """Where a silo listens, plus the generation of the process behind it."""

    host: str
    port: int
    generation: int = 0
    # Every outgoing call looks its target up by address and by endpoint:
    # both are computed once here instead of on each call.
    endpoint: str = field(init=False, repr=False, compare=False, hash=False)
    _hash: int = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoint", f"{self.host}:{self.port}")
        object.__setattr__(self, "_hash", hash((self.host, self.port, self.generation)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return f"{self.host}:{self.port}@{self.generation}"

    @classmethod
    def parse(cls, text: str) -> SiloAddress:
        endpoint, _, gen = text.partition("@")
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"not a silo address: {text!r}")
        return cls(host, int(port), int(gen) if gen else 0)
