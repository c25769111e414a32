"""The promises every partition scenario checks at its end (docs/reliability.md).

1. *Every call answered within its deadline*: each call a workload made has an
   end record, no later than its deadline plus a little slack, and an error
   only from the documented set.
2. *No acknowledged write lost*: every operation a client got a result for is
   in the grain's final state, exactly once.
3. *Never two activations writing state for one grain*: in the order of the
   state's own write sequence, accepted writes come from activations that
   never interleave (once B has written, A never writes again), no sequence
   number was accepted twice, and the run of writers the state records
   itself never returns to an earlier activation.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import redis

from tests.netns.grains import log_key

DOCUMENTED = {
    "GrainTimeoutError",
    "SiloUnavailableError",
    "SiloNotServingError",
    "SiloClosedError",
    "GrainDeactivatedError",
    "OverloadedError",
    "StorageError",
    "StateConflictError",
}
SLACK_S = 1.0
"""How far past its deadline an answer may come (a loaded 2-core machine; clock reads)."""


def check_calls(records: list[dict[str, Any]], timeout_s: float, *, slack_s: float = SLACK_S) -> list[str]:
    problems: list[str] = []
    starts = {(r["w"], r["op"]) for r in records if r.get("ev") == "start"}
    ends = {(r["w"], r["op"]): r for r in records if r.get("ev") == "end"}
    for missing in sorted(starts - set(ends))[:5]:
        problems.append(f"call {missing} never ended (workload stopped with it in flight)")
    for r in ends.values():
        took = r["t1"] - r["t0"]
        if took > timeout_s + slack_s:
            problems.append(f"{r['m']} {r['key']} {r['op']}: answered after {took:.2f}s, deadline {timeout_s}s ({r.get('err', 'ok')})")
        if not r["ok"] and r["err"] not in DOCUMENTED:
            problems.append(f"{r['m']} {r['key']} {r['op']}: undocumented outcome {r['err']}: {r.get('msg', '')}")
    return problems


def acked_ops(records: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Grain key -> operation ids a client got a result for (add_via adds to ``key-b``)."""
    out: dict[str, set[str]] = defaultdict(set)
    for r in records:
        if r.get("ev") == "end" and r["ok"]:
            out[f"{r['key']}-b" if r["m"] == "add_via" else r["key"]].add(r["op"])
    return out


def check_acked(acked: dict[str, set[str]], final: dict[str, list[str]]) -> list[str]:
    problems = []
    for key, ops in acked.items():
        have = final.get(key, [])
        twice = [op for op, n in Counter(have).items() if n > 1]
        if twice:
            problems.append(f"{key}: operations applied twice: {twice[:5]}")
        lost = ops - set(have)
        if lost:
            problems.append(f"{key}: {len(lost)} acknowledged operations lost, e.g. {sorted(lost)[:5]}")
    return problems


def check_writers(writers: dict[str, list[str]]) -> list[str]:
    """The state's own record of who wrote it: an activation never writes again after another did."""
    return [
        f"{key}: activation {act} wrote again after another activation had written ({runs})"
        for key, runs in writers.items()
        for act, n in Counter(runs).items()
        if n > 1
    ]


def read_log(r: redis.Redis, cluster: str) -> list[dict[str, str]]:
    entries: list[dict[str, str]] = []
    last = "-"
    while True:
        batch: list[Any] = list(r.xrange(log_key(cluster), min=last, max="+", count=10_000) or [])
        if last != "-":
            batch = batch[1:]
        if not batch:
            return entries
        for _, raw in batch:
            entries.append({k.decode(): v.decode() for k, v in raw.items()})
        last = bytes(batch[-1][0]).decode()


def check_single_writer(entries: list[dict[str, str]]) -> list[str]:
    """Accepted writes, ordered by the state's sequence, come from activations that never interleave."""
    problems: list[str] = []
    by_seq: dict[str, dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for e in entries:
        if e["event"] == "write":
            by_seq[e["grain"]][int(e["seq"])].add(e["act"])
    for grain, seqs in by_seq.items():
        finished: set[str] = set()
        current = None
        for seq in sorted(seqs):
            acts = seqs[seq]
            if len(acts) > 1:
                problems.append(f"{grain}: write #{seq} accepted from {len(acts)} activations")
            act = min(acts)
            if act != current:
                if act in finished:
                    problems.append(f"{grain}: activation {act} wrote #{seq} after another activation wrote")
                if current is not None:
                    finished.add(current)
                current = act
    return problems
