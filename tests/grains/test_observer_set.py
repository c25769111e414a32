"""ObserverSet on its own: subscriptions, expiry on a fake clock, notify's concurrency and failures.

The references call through a caller of the test's own (the runtime's hub is
tested with real silos in tests/silo/test_observers.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from grains import ObserverId, ObserverRef, ObserverSet


class Gone(Exception):
    pass


class FakeCaller:
    """Calls ``behaviour[local_id](method, args)``; Gone means the observer is gone."""

    def __init__(self) -> None:
        self.behaviour: dict[str, Any] = {}
        self.calls: list[tuple[str, str, tuple[Any, ...]]] = []

    async def invoke_observer(
        self, ref: ObserverRef, method: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None, one_way: bool
    ) -> Any:
        self.calls.append((ref.observer_id.local_id, method, args))
        return await self.behaviour[ref.observer_id.local_id](method, args)

    async def dispose_observer(self, ref: ObserverRef) -> None:
        pass

    def is_gone(self, exc: BaseException) -> bool:
        return isinstance(exc, Gone)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _ref(caller: FakeCaller, name: str, behaviour: Any = None) -> ObserverRef:
    async def ok(method: str, args: tuple[Any, ...]) -> str:
        return f"{name} {method}"

    caller.behaviour[name] = behaviour or ok
    return ObserverRef(caller, ObserverId("client:c", name), frozenset({"on_event"}))


def test_an_entry_not_renewed_within_the_expiry_is_dropped_and_resubscribing_renews() -> None:
    clock, caller = Clock(), FakeCaller()
    s = ObserverSet(expiry_s=10.0, clock=clock)
    a, b = _ref(caller, "a"), _ref(caller, "b")
    s.subscribe(a)
    clock.now += 6
    s.subscribe(b)
    clock.now += 3
    s.subscribe(a)  # renewed at 109: now expires at 119, b at 116
    clock.now += 5  # 114: both in
    assert len(s) == 2 and set(s) == {a, b}
    clock.now += 2  # 116: b's 10 s are up
    assert list(s) == [a] and b not in s
    clock.now += 3  # 119
    assert s.expire() == [a] and len(s) == 0


async def test_notify_drops_expired_entries_before_calling() -> None:
    clock, caller = Clock(), FakeCaller()
    s = ObserverSet(expiry_s=1.0, clock=clock)
    s.subscribe(_ref(caller, "old"))
    clock.now += 1.5
    s.subscribe(_ref(caller, "new"))
    result = await s.notify("on_event", 1)
    assert result.delivered == 1 and [c[0] for c in caller.calls] == ["new"]


async def test_notify_calls_all_at_once_and_one_failure_stops_none_of_the_others() -> None:
    caller = FakeCaller()
    started: list[str] = []
    all_started = asyncio.Event()

    def waiting(name: str, fail: BaseException | None = None) -> Any:
        async def run(method: str, args: tuple[Any, ...]) -> str:
            started.append(name)
            if len(started) == 4:
                all_started.set()
            await all_started.wait()  # only returns if every call is running at once
            if fail is not None:
                raise fail
            return name

        return run

    s = ObserverSet()
    ok1, gone, broken, ok2 = (
        _ref(caller, "ok1", waiting("ok1")),
        _ref(caller, "gone", waiting("gone", Gone())),
        _ref(caller, "broken", waiting("broken", ValueError("handler bug"))),
        _ref(caller, "ok2", waiting("ok2")),
    )
    for r in (ok1, gone, broken, ok2):
        s.subscribe(r)
    result = await asyncio.wait_for(s.notify("on_event", "x"), 5)
    assert result.delivered == 2
    assert result.gone == [gone] and gone not in s  # gone: dropped
    assert list(result.failed) == [broken] and isinstance(result.failed[broken], ValueError)
    assert broken in s and len(s) == 3  # failed otherwise: kept (until it expires)


async def test_notify_with_a_callable_gets_each_observer() -> None:
    caller = FakeCaller()
    s = ObserverSet()
    a = _ref(caller, "a")
    s.subscribe(a)
    seen: list[ObserverRef] = []

    async def tell(obs: ObserverRef) -> None:
        seen.append(obs)
        await obs.on_event("direct")

    assert (await s.notify(tell)).delivered == 1 and seen == [a]
    assert caller.calls == [("a", "on_event", ("direct",))]
    with pytest.raises(TypeError, match="no further arguments"):
        await s.notify(tell, 1)
    # A method one observer lacks fails that one alone.
    b = ObserverRef(caller, ObserverId("client:c", "b"), frozenset({"on_event", "on_other"}))
    caller.behaviour["b"] = caller.behaviour["a"]
    s.subscribe(b)
    result = await s.notify("on_other")
    assert result.delivered == 1 and isinstance(result.failed[a], AttributeError) and len(s) == 2


def test_subscribe_unsubscribe_and_bad_input() -> None:
    caller = FakeCaller()
    s = ObserverSet()
    a = _ref(caller, "a")
    s.subscribe(a)
    s.subscribe(ObserverRef(caller, a.observer_id, a.methods))  # the same observer: one entry
    assert len(s) == 1
    assert s.unsubscribe(a) and not s.unsubscribe(a)
    with pytest.raises(TypeError, match="ObserverRef"):
        s.subscribe("client:c/a")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expiry_s"):
        ObserverSet(expiry_s=0)
    with pytest.raises(AttributeError, match="no public async method 'other'"):
        a.other  # noqa: B018
