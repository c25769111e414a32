"""Invariant checkers over a simulated run's recorded history.

Each checker reads :class:`History` after the run and returns the first
violation it finds (``None``: the promise held). They know nothing of the
runtime's internals: only what callers saw (invocations and their outcomes,
on virtual time), what grains did (one-way appends run), and what the Redis
twins accepted (directory registrations, state writes).

* ``linearizable``: per register grain, the acknowledged operations have a
  linearization (Wing & Gong's search with Lowe's memoisation, as Knossos and
  Porcupine check histories): a read returns the value of the last write
  linearized before it. A write whose caller got an error may have happened
  or not (its outcome is unknown); a read that failed says nothing. Reads
  after the faults heal make "no acknowledged write lost" part of this check.
* ``single_writer``: the state writes the store accepted for one grain carry
  non-decreasing fencing tokens (a fenced-off activation never writes after
  its successor).
* ``single_activation``: a grain's directory entry passes to another
  activation only when the membership table no longer counts its owner live.
* ``deadline``: every call ends (answered or failed) within its timeout plus
  ``DEADLINE_SLACK_S``.
* ``one_way_order``: the one-way calls of one sender run in the order it
  sent them, within each activation (a lost call is allowed; a call that
  overtakes an earlier one is not).
* ``one_way_delivered``: in a scenario without faults, no one-way call is lost
  silently: every one that did not run was counted lost by a silo (shed past
  the mailbox's bound, or its deadline passed); deactivations re-route.
* ``no_fault_no_error``: in a scenario without faults, every call succeeds.
* ``no_task_left``: a silo that stopped leaves no task running.

The ``services`` scenario runs the silo's Redis-direct services on the
command-level twin (:mod:`silo.testing.sim.redis_twin`) and adds three
(each passes trivially elsewhere: :class:`ServiceRecord` is empty):

* ``reminder_ticks``: a registered reminder ticks at least once a period:
  between two ticks (and from its registration to the first, from the last to
  the end of the run), the time not covered by a fault window, each window
  stretched by ``RECOVERY_S`` after it heals, is at most a period plus
  ``TICK_SLACK_S``.
* ``timer_ticks``: a grain's timer never ticks twice within one period on one
  activation, and some activation of the grain ticks as often as a reminder
  must (the same gap rule, with the timer's period).
* ``stream_delivered``: every item whose publish was acknowledged was delivered
  to the subscribed grain at least once, or written to the namespace's dead
  letters; per stream key, items are first delivered in token order.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEADLINE_SLACK_S = 1.0
"""How late past its timeout a call may end: one probe/retry period of the router's back-off."""

RECOVERY_S = 10.0
"""How long after a fault heals reminders and timers may stay quiet: a crashed claimer's lease
(delivery deadline + 2 s slack) running out, or a dead owner being declared dead (dead_after_s
and the votes) before its grain activates elsewhere."""

TICK_SLACK_S = 1.0
"""How late past its period a tick may come with no fault near: the pollers' floor and the
delivery's own latency."""


@dataclass(slots=True)
class ServiceRecord:
    """What the Redis-direct services did (the ``services`` scenario; empty elsewhere)."""

    reminders: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Grain key -> (when its reminder's registration was acknowledged, period)."""
    ticks: list[tuple[str, float]] = field(default_factory=list)
    """(grain key, time) of each reminder tick its grain received."""
    timers: dict[str, float] = field(default_factory=dict)
    """Grain key -> timer period (from its first activation)."""
    timer_started: dict[str, float] = field(default_factory=dict)
    """Grain key -> when its first activation registered the timer."""
    timer_ticks: list[tuple[str, int, float]] = field(default_factory=list)
    """(grain key, activation number, time) of each timer tick."""
    published: dict[tuple[str, str], int] = field(default_factory=dict)
    """(stream key, token) -> item, for each acknowledged publish (a token is unique per key)."""
    delivered: list[tuple[str, str, int]] = field(default_factory=list)
    """(stream key, token, item) of each on_stream_item turn, in the order they ran."""
    dead_letters: set[tuple[str, str]] = field(default_factory=set)
    """(stream key, token) of each entry in the namespace's dead-letter stream at the end."""
    windows: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of each fault: while it lasts (and RECOVERY_S after), ticks may pause."""
    end: float = 0.0
    """When the workload's checks stop counting (after the faults healed and the cluster settled)."""


@dataclass(slots=True)
class Op:
    """One call a client made, as it saw it."""

    client: str
    grain: str
    method: str
    arg: Any
    start: float
    timeout_s: float
    end: float | None = None
    """When the caller learnt the outcome (None: still waiting when the run ended)."""
    ok: bool = False
    result: Any = None
    error: str = ""


@dataclass(slots=True)
class History:
    ops: list[Op] = field(default_factory=list)
    applied: list[tuple[str, int, str, int]] = field(default_factory=list)
    """(grain, incarnation, sender, seq) for each one-way append, in the order they ran."""
    writes: list[tuple[float, str, int, int]] = field(default_factory=list)
    """(time, grain, fencing token, the directory's token then) of each state write the store accepted."""
    moves: list[tuple[float, str, str, str, bool]] = field(default_factory=list)
    """(time, grain, old owner, new owner, old owner live) for each registration that changed owner."""
    sent: dict[tuple[str, int], float] = field(default_factory=dict)
    """(sender, seq) -> when the one-way call was sent."""
    applied_at: list[float] = field(default_factory=list)
    """When each entry of ``applied`` ran."""
    disruptions: list[float] = field(default_factory=list)
    """When a fault struck or a grain activated anew: the order of calls re-routed across one is not promised."""
    one_way_counted: int = 0
    """One-way calls the silos counted as lost (``one_way_failed``): shed past the mailbox's
    bound, deadline passed, the method raised."""
    failovers: list[float] = field(default_factory=list)
    """When the simulated Redis master died (its replica promoted)."""
    short_writes: list[tuple[float, str, float]] = field(default_factory=list)
    """(acknowledged at, grain, replicated at) of each state write or registration acknowledged
    before the replica had it: a ``WAIT`` that ran out, or one not waited for."""
    leaks: list[tuple[str, str]] = field(default_factory=list)
    """(silo, task) for tasks still running after their silo stopped."""
    streams: list[StreamOp] = field(default_factory=list)
    notes: list[tuple[str, int]] = field(default_factory=list)
    """(client, seq) each time a client's observer handler ran for ``SimRoom.say(seq)``."""
    said: list[tuple[int, list[str]]] = field(default_factory=list)
    """(seq, the clients whose observer answered) for each ``say`` that returned."""
    generators_left: list[tuple[str, str]] = field(default_factory=list)
    """(stream, silo) of each generator still running on a live silo once the run settled."""
    open_connections: list[tuple[str, str]] = field(default_factory=list)
    """(silo or client, "local -> remote") for connection ends still open after their owner stopped."""
    faults: int = 0
    services: ServiceRecord = field(default_factory=ServiceRecord)


@dataclass(slots=True)
class StreamOp:
    """One streamed-result call (``SimCounter.count``) as its caller saw it."""

    client: str
    stream: str
    n: int
    """Items the generator yields when nobody stops it."""
    leave_after: int | None
    """The caller breaks out of its loop after this many items (None: reads to the end)."""
    start: float
    timeout: float
    items: list[int] = field(default_factory=list)
    received_at: list[float] = field(default_factory=list)
    end: float | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


def lost_acknowledged(h: History) -> list[tuple[float, str]]:
    """(failover, grain) for each write or registration acknowledged short of its replica and
    lost by that failover: what docs/reliability.md says a failover may lose ("And what is not")."""
    return [(at, grain) for acked, grain, replicated in h.short_writes for at in h.failovers if acked <= at < replicated]


def linearizable(h: History) -> Violation | None:
    # A register whose acknowledged write (or activation's registration) a failover lost
    # is not held to it: the promise is for writes whose WAIT the replica answered.
    excused = {grain.partition("/")[2] for _, grain in lost_acknowledged(h)}
    by_grain: dict[str, list[Op]] = defaultdict(list)
    for op in h.ops:
        if op.grain in excused:
            continue
        if op.method in ("write", "read"):
            by_grain[op.grain].append(op)
    for grain in sorted(by_grain):
        ops = by_grain[grain]
        read = {o.result for o in ops if o.method == "read" and o.ok}
        # A write whose outcome is unknown and whose value nobody read can always be taken
        # as never done (it constrains nothing); one that was read must have been done.
        ops = [o for o in ops if o.ok or (o.method == "write" and o.arg in read)]
        if not _register_linearizable(ops, read):
            acked = [(o.method, o.arg if o.method == "write" else o.result, round(o.start, 3), o.end and round(o.end, 3))
                     for o in ops if o.ok][-6:]  # fmt: skip
            return Violation("linearizable", f"register {grain} has no linearization (last acknowledged: {acked})")
    return None


def _register_linearizable(ops: list[Op], read: set[Any]) -> bool:
    inf = float("inf")
    ends = [o.end if o.ok and o.end is not None else inf for o in ops]
    must = 0
    for i, o in enumerate(ops):
        if o.ok or (o.method == "write" and o.arg in read):
            must |= 1 << i
    seen: set[tuple[int, int]] = set()
    stack: list[tuple[int, int]] = [(0, 0)]
    while stack:
        done, value = stack.pop()
        if done & must == must:
            return True
        if (done, value) in seen:
            continue
        seen.add((done, value))
        horizon = min((ends[i] for i in range(len(ops)) if not done >> i & 1), default=inf)
        for i, o in enumerate(ops):
            if done >> i & 1 or o.start > horizon:
                continue
            if o.method == "write":
                stack.append((done | 1 << i, o.arg))
            elif o.result == value:
                stack.append((done | 1 << i, value))
    return False


def single_writer(h: History) -> Violation | None:
    last: dict[str, tuple[int, float]] = {}
    for at, grain, token, owner in h.writes:
        if token and token != owner:
            return Violation(
                "single_writer", f"{grain}: a write with fencing token {token} was accepted at t={at:.3f} while the directory named token {owner}"
            )
        prev = last.get(grain)
        if prev is not None and token < prev[0]:
            return Violation(
                "single_writer",
                f"{grain}: a write with fencing token {token} was accepted at t={at:.3f} after one with {prev[0]} (t={prev[1]:.3f})",
            )
        last[grain] = (token, at)
    return None


def single_activation(h: History) -> Violation | None:
    for at, grain, old, new, old_live in h.moves:
        if old_live:
            return Violation("single_activation", f"{grain} passed from live {old} to {new} at t={at:.3f}")
    return None


def deadline(h: History) -> Violation | None:
    for op in h.ops:
        limit = op.start + op.timeout_s + DEADLINE_SLACK_S
        end = op.end
        if end is None or end > limit:
            took = "never ended" if end is None else f"ended after {end - op.start:.3f} s"
            return Violation(
                "deadline", f"{op.client} {op.method}({op.arg}) on {op.grain} at t={op.start:.3f} with a {op.timeout_s} s timeout {took}"
            )
    return None


def one_way_order(h: History) -> Violation | None:
    last: dict[tuple[str, int, str], int] = {}
    for (grain, incarnation, sender, seq), at in zip(h.applied, h.applied_at, strict=True):
        key = (grain, incarnation, sender)
        prev = last.get(key)
        if prev is not None and seq < prev:
            # docs/concepts.md: a call re-routed after a deactivation or a silo's death may
            # land after later ones; only an overtaking with no such event between is a break.
            sent = h.sent.get((sender, seq), at)
            if not any(sent <= d <= at for d in h.disruptions):
                return Violation("one_way_order", f"{grain}: {sender}'s one-way call #{seq} ran after #{prev}")
        last[key] = max(seq, prev or 0)
    return None


def no_fault_no_error(h: History) -> Violation | None:
    if h.faults:
        return None
    for op in h.ops:
        if not op.ok:
            return Violation(
                "no_fault_no_error", f"{op.client} {op.method}({op.arg}) on {op.grain} at t={op.start:.3f} failed with no fault injected: {op.error}"
            )
    return None


def one_way_delivered(h: History) -> Violation | None:
    """Without a fault, no one-way call is lost silently: each runs, or its silo counted it
    lost (``one_way_failed``: shed past the mailbox's bound, its deadline passed). A full
    mailbox delays it, a deactivation re-routes it; neither drops it uncounted (issue 36's
    first defect was such a drop)."""
    if h.faults:
        return None
    ran = {(sender, seq) for _, _, sender, seq in h.applied}
    lost = [(at, sender, seq) for (sender, seq), at in h.sent.items() if (sender, seq) not in ran]
    if len(lost) > h.one_way_counted:
        at, sender, seq = min(lost)
        return Violation("one_way_delivered", f"{len(lost)} one-way calls never ran and {h.one_way_counted} were counted lost, "
                         f"with no fault injected (the first: {seq} of {sender}, sent at t={at:.3f})")  # fmt: skip
    return None


def no_task_left(h: History) -> Violation | None:
    if h.leaks:
        silo, task = h.leaks[0]
        return Violation("no_task_left", f"silo {silo} stopped with a task still running: {task}")
    return None


def stream_results(h: History) -> Violation | None:
    """A streamed call's caller gets a prefix of the items in order, no item twice; all of them
    when nothing failed and it did not leave; each within its per-item deadline (plus slack);
    and a generator whose caller left, failed or finished is not still running once the run
    settled (docs/concepts.md, "Streamed results")."""
    for op in h.streams:
        if op.items != list(range(len(op.items))):
            return Violation("stream_results", f"{op.client}'s stream {op.stream} got {op.items}: not 0, 1, 2, ... in order")
        wanted = op.n if op.leave_after is None else min(op.n, op.leave_after)
        if op.error is None and len(op.items) != wanted:
            return Violation("stream_results", f"{op.client}'s stream {op.stream} ended without an error after "
                                               f"{len(op.items)} of {wanted} items")  # fmt: skip
        steps = [op.start, *op.received_at, *([] if op.end is None else [op.end])]
        for a, b in itertools.pairwise(steps):
            if b - a > op.timeout + DEADLINE_SLACK_S:
                return Violation("stream_results", f"{op.client}'s stream {op.stream}: a step took {b - a:.2f} s, "
                                                   f"past its {op.timeout} s deadline")  # fmt: skip
    if h.generators_left:
        stream, silo = h.generators_left[0]
        return Violation("stream_results", f"the generator of stream {stream} still runs on {silo} after its caller left")
    return None


def observer_notes(h: History) -> Violation | None:
    """An observer call runs its handler at most once (it is not retried: docs/concepts.md,
    "Observers"), and a notification the grain saw answered was received."""
    seen: set[tuple[str, int]] = set()
    for note in h.notes:
        if note in seen:
            return Violation("observer_notes", f"{note[0]}'s observer ran notification {note[1]} twice")
        seen.add(note)
    for seq, answered in h.said:
        for client in answered:
            if (client, seq) not in seen:
                return Violation("observer_notes", f"notification {seq} answered for {client}, whose handler never ran")
    return None


def no_connection_left(h: History) -> Violation | None:
    if h.open_connections:
        owner, conn = h.open_connections[0]
        return Violation("no_connection_left", f"{owner} stopped with a connection still open: {conn}")
    return None


def _uncovered(start: float, end: float, windows: list[tuple[float, float]]) -> float:
    """Length of ``[start, end]`` outside every window (each stretched by RECOVERY_S)."""
    cut = [(max(a, start), min(b + RECOVERY_S, end)) for a, b in sorted(windows)]
    covered, reach = 0.0, start
    for a, b in cut:
        a = max(a, reach)
        if b > a:
            covered += b - a
            reach = b
    return (end - start) - covered


def _quiet(name: str, key: str, times: list[float], start: float, period: float, r: ServiceRecord) -> Violation | None:
    points = [start, *sorted(t for t in times if t >= start), r.end]
    for a, b in itertools.pairwise(points):
        quiet = _uncovered(a, b, r.windows)
        if quiet > period + TICK_SLACK_S:
            return Violation(name, f"{key} (period {period} s) had no tick from t={a:.3f} to t={b:.3f}: "
                             f"{quiet:.2f} s of it with no fault near")  # fmt: skip
    return None


def reminder_ticks(h: History) -> Violation | None:
    r = h.services
    for key, (registered, period) in sorted(r.reminders.items()):
        found = _quiet("reminder_ticks", key, [t for k, t in r.ticks if k == key], registered, period, r)
        if found is not None:
            return found
    return None


def timer_ticks(h: History) -> Violation | None:
    r = h.services
    last: dict[tuple[str, int], float] = {}
    for key, activation, at in r.timer_ticks:
        before = last.get((key, activation))
        if before is not None and at - before < r.timers[key] - 1e-6:
            return Violation("timer_ticks", f"{key}'s timer ticked twice within its period on one activation: "
                             f"t={before:.3f} and t={at:.3f}")  # fmt: skip
        last[(key, activation)] = at
    for key, period in sorted(r.timers.items()):
        found = _quiet("timer_ticks", key, [t for k, _, t in r.timer_ticks if k == key], r.timer_started[key], period, r)
        if found is not None:
            return found
    return None


def stream_delivered(h: History) -> Violation | None:
    r = h.services
    seen: set[tuple[str, str]] = set()
    newest: dict[str, tuple[int, int]] = {}
    for key, token, item in r.delivered:
        if (key, token) in seen:
            continue  # again (at least once): a later holder resumes after the last acknowledged
        seen.add((key, token))
        ms, _, n = token.partition("-")
        at = (int(ms), int(n))
        if key in newest and at < newest[key]:
            return Violation("stream_delivered", f"item {item} ({token}) of stream {key} was first delivered after a later one")
        newest[key] = at
        if r.published.get((key, token), item) != item:
            return Violation("stream_delivered", f"token {token} of {key} delivered item {item}, published as {r.published[(key, token)]}")
    lost = sorted(kt for kt in r.published if kt not in seen and kt not in r.dead_letters)
    if lost:
        key, token = lost[0]
        return Violation("stream_delivered", f"{len(lost)} acknowledged items neither delivered nor dead-lettered "
                         f"(the first: item {r.published[lost[0]]} of {key}, token {token})")  # fmt: skip
    return None


CHECKS: list[Callable[[History], Violation | None]] = [
    single_activation,
    single_writer,
    linearizable,
    one_way_order,
    one_way_delivered,
    deadline,
    no_fault_no_error,
    no_task_left,
    no_connection_left,
    stream_results,
    observer_notes,
    reminder_ticks,
    timer_ticks,
    stream_delivered,
]


ALL_CHECKS = list(CHECKS)


def check(h: History) -> Violation | None:
    """The first violation of any invariant, in the order of :data:`CHECKS`."""
    for checker in CHECKS:
        found = checker(h)
        if found is not None:
            return found
    return None
