"""Redis Cluster slot rules of the key layout (silo/keys.py) and of every Lua script."""

from __future__ import annotations

import importlib
import re

import pytest

from silo.keys import Keys, chunk_key, slot_of

K = Keys("prod")
GRAINS = ["Counter/a", "Shard/job/0", "Odd/{braces}", "Odd/}first", "Type/ünï"]

# Every module that registers a Lua script.
SCRIPT_MODULES = (
    "silo.cluster.directory", "silo.cluster.membership", "silo.cluster.reminders", "silo.cluster.housekeeping",
    "silo.cluster.rebalancer", "silo.storage.store", "silo.storage.checkpoint", "silo.streams.agent",
    "silo.streams.stream", "silo.streams.retention",
    "grains.training.strategies.allreduce.rendezvous",
)  # fmt: skip


@pytest.mark.parametrize("grain", GRAINS)
def test_a_grains_entry_state_chunks_and_snapshot_blobs_share_its_own_slot(grain: str) -> None:
    slot = slot_of(K.directory_entry(grain))
    same = [
        K.state_head(grain), chunk_key(K.state_chunk_base(grain), "etag", 3),
        K.named_state_head(grain, "meta"), chunk_key(K.named_state_chunk_base(grain, "meta"), "e", 0),
        K.checkpoint_member("g", "1", grain), chunk_key(K.checkpoint_chunk_base("g", "1", grain), "e", 1),
        K.fencing_counter(grain), K.fencing_term(grain),
    ]  # fmt: skip
    assert {slot_of(k) for k in same} == {slot}


def test_grains_spread_over_slots_while_cluster_wide_records_keep_theirs() -> None:
    slots = {slot_of(K.directory_entry(f"Counter/{i}")) for i in range(1000)}
    assert len(slots) > 900  # ~970 expected for 1,000 grains over 16,384 slots
    control = {slot_of(k) for k in (K.members, K.members_version, K.heartbeat("s"), K.suspicions("s"),
                                    K.generation, K.directory_index("s"), K.state_index("T"), K.state_types(),
                                    K.checkpoint_manifest("g", "1"), K.checkpoint_index("g"), K.fencing_counter())}  # fmt: skip
    reminders = {slot_of(k) for k in (K.reminders, K.reminder_rows, K.reminder_fired)}
    assert len(control) == 1 and len(reminders) == 1 and control != reminders
    assert slot_of(K.leader("rebalancer")) not in control | reminders
    # Another cluster's keys are its own.
    assert Keys("other").directory_entry("Counter/a") != K.directory_entry("Counter/a")


def test_named_state_keys_cannot_collide_with_each_other_or_a_chunk() -> None:
    names = ["a", "a:v", "a:vx:0", "b"]
    heads = {K.named_state_head("T/k", n) for n in names}
    chunks = {chunk_key(K.named_state_chunk_base("T/k", n), "x", 0) for n in names}
    assert len(heads) == len(names) and not heads & chunks


def _scripts() -> list[tuple[str, str]]:
    found = []
    for name in SCRIPT_MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if isinstance(value, str) and "redis.call(" in value:
                found.append((f"{name}.{attr}", value))
    return found


def test_no_script_builds_a_key_name() -> None:
    """Redis Cluster routes a script by its declared KEYS: a name built in Lua may be in another slot."""
    scripts = _scripts()
    assert len(scripts) > 15
    call = re.compile(r"redis\.call\(\s*'(\w+)'\s*,\s*([^,)]+)")
    keyless = {"INFO", "TIME", "CLUSTER"}
    # Commands whose key follows a subcommand or an option list: the key must still be KEYS[..].
    keyed_later = re.compile(r"redis\.call\(\s*'(XINFO|XGROUP|XREADGROUP|XREAD)'\s*,([^)]*)\)")
    for where, text in scripts:
        for command, args in keyed_later.findall(text):
            assert ".." not in args and "KEYS[" in args, f"{where}: {command} {args}"
        for command, first in call.findall(text):
            if command.upper() in keyless or command.upper() in {"XINFO", "XGROUP", "XREADGROUP", "XREAD"}:
                continue
            assert ".." not in first, f"{where}: {command} on a key built in Lua: {first}"
            assert re.fullmatch(r"KEYS\[[^\]]+\]|[a-z_]+", first.strip()), f"{where}: {command} {first}"
