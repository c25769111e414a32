"""Grains, filters and startup tasks of the extension-point tests (named states, storage
providers, call filters from settings, ``@on_silo_start``); silo processes load this module.

The filters record what they see in ``SEEN`` (this test process's silos) and mark what they
pass on, so a test in another process sees from the answer alone that a filter ran.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel

from grains import Grain, incoming_filter, on_silo_start, outgoing_filter
from silo.errors import StorageError

SEEN: list[tuple[str, str, str | None]] = []
"""(filter, "Type.method", caller) of every call a filter saw, in order."""


class ProfileState(BaseModel):
    name: str = ""
    visits: int = 0


class Prefs(BaseModel):
    theme: str = "light"


class Account(Grain):
    class State(BaseModel):
        balance: int = 0

    def __init__(self) -> None:
        self.profile = self.named_state("profile", ProfileState)
        self.prefs = self.named_state("prefs", Prefs)

    async def deposit(self, n: int) -> int:
        self.state.balance += n
        await self.write_state()
        return int(self.state.balance)

    async def rename(self, name: str) -> int:
        self.profile.value.name = name
        self.profile.value.visits += 1
        await self.profile.write()
        return self.profile.value.visits

    async def set_theme(self, theme: str) -> None:
        self.prefs.state.theme = theme  # .state: the same value as .value
        await self.prefs.write()

    async def view(self) -> dict[str, Any]:
        return {
            "balance": self.state.balance,
            "name": self.profile.value.name,
            "visits": self.profile.value.visits,
            "theme": self.prefs.value.theme,
        }

    async def forget_profile(self) -> None:
        await self.profile.clear()

    async def late_state(self) -> list[str]:
        """A named state first asked for after activation: unloaded until read."""
        late = self.named_state("late", Prefs)
        seen = []
        try:
            _ = late.value
        except StorageError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
        await late.read()
        seen.append(late.value.theme)
        late.value.theme = "dark"
        await late.write()
        return seen

    async def same_name_other_model(self) -> None:
        self.named_state("profile", Prefs)


# --- call filters ------------------------------------------------------------------


def _where(ctx: Any) -> str:
    return f"{ctx.grain_id.type_name}.{ctx.method}"


class Tagging:
    """Incoming: marks a str answer with ``[in]``; loaded by import path (a class: instantiated)."""

    async def __call__(self, ctx: Any, call_next: Any) -> Any:
        SEEN.append(("in", _where(ctx), None))
        result = await call_next(ctx)
        return f"[in]{result}" if isinstance(result, str) else result


async def second_incoming(ctx: Any, call_next: Any) -> Any:
    SEEN.append(("in2", _where(ctx), None))
    return await call_next(ctx)


async def code_incoming(ctx: Any, call_next: Any) -> Any:
    SEEN.append(("code", _where(ctx), None))
    return await call_next(ctx)


async def stamping_outgoing(ctx: Any, call_next: Any) -> Any:
    """Outgoing: appends ``+out`` to a call's first str argument (a changed context passed on)."""
    SEEN.append(("out", _where(ctx), ctx.caller))
    call = ctx.call
    if call.args and isinstance(call.args[0], str):
        ctx = dataclasses.replace(ctx, call=call._replace(args=(call.args[0] + "+out", *call.args[1:])))
    return await call_next(ctx)


async def echo_class_filter(ctx: Any, call_next: Any) -> Any:
    SEEN.append(("echo-class", _where(ctx), None))
    return await call_next(ctx)


async def relay_class_outgoing(ctx: Any, call_next: Any) -> Any:
    SEEN.append(("relay-class-out", _where(ctx), ctx.caller))
    return await call_next(ctx)


@incoming_filter(echo_class_filter)
class Echo(Grain):
    async def echo(self, text: str) -> str:
        return text


@outgoing_filter(relay_class_outgoing)
class Relay(Grain):
    async def relay(self, text: str) -> str:
        return str(await self.get_grain(Echo, self.key).echo(text))


# --- startup tasks ---------------------------------------------------------------------


class BootLog(Grain):
    class State(BaseModel):
        entries: list[str] = []

    async def record(self, entry: str) -> None:
        self.state.entries.append(entry)
        await self.write_state()

    async def entries(self) -> list[str]:
        return list(self.state.entries)


@on_silo_start
async def record_boot(silo: Any) -> None:
    """Calls a grain (which may live on this very silo) before the silo reports ready."""
    await silo.get_grain(BootLog, "boot").record(f"started {silo.address}")


@on_silo_start
async def second_task() -> None:
    """Takes no parameter; runs after record_boot (definition order)."""
    SEEN.append(("startup", "second_task", None))
