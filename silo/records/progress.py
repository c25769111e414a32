"""Job progress: the record, history and cancel flag a workload publishes for its jobs.

A workload publishes through the public grain API (``Grain.publish_progress``),
which calls :func:`publish_progress`; the record's schema lives with the
workload (``grains/training/api/records.py``). The cancel flag is written by
:func:`silo.records.control.request_cancel`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis

from silo.keys import Keys
from silo.redis_util import redis_errors

JOB_HISTORY_MAXLEN = 10_000
"""History points kept per job (a capped stream: curves over the last 10k steps)."""

_CAPPED = (b"MAXLEN", b"~", str(JOB_HISTORY_MAXLEN).encode(), b"*")
"""XADD's arguments before an entry's fields: trimmed to about ``JOB_HISTORY_MAXLEN``, a new id."""


async def publish_progress(
    redis: aioredis.Redis,
    keys: Keys,
    job: str,
    record: str,
    point: Mapping[str, str] | Sequence[Mapping[str, str]] | None,
    *,
    restart: bool = False,
) -> bool:
    """Publish a job's latest record (JSON) and history points; True if a cancel was asked.

    One pipelined round trip: SET the record under ``keys.job_progress``, XADD
    the point (or points, in order) to the capped ``keys.job_history`` stream, SADD the job to
    ``keys.jobs``, and read the cancel flag :func:`request_cancel` sets. The
    record's schema is the workload's (``grains/training/api/records.py``).
    ``restart``: the stream is deleted first, so it holds these points alone (the job's
    history lost points: a stream is append-only).
    """
    points = [point] if isinstance(point, Mapping) else list(point or ())
    with redis_errors(f"publish progress of job {job}"):
        async with redis.pipeline(transaction=restart) as pipe:
            pipe.set(keys.job_progress(job), record)
            if restart:
                pipe.delete(keys.job_history(job))
            history = keys.job_history(job)
            for p in points:
                if p:
                    # XADD spelled out, its arguments already bytes: a job publishes a point a
                    # step, and redis-py's xadd() and its encoding of each str argument were most
                    # of the coordinator's calls a step on a sub-millisecond step.
                    pipe.execute_command("XADD", history, *_CAPPED, *[x.encode() for kv in p.items() for x in kv])
            pipe.sadd(keys.jobs, job)
            pipe.exists(keys.job_cancel(job))
            result = await pipe.execute()
    return bool(result[-1])


async def forget_progress(redis: aioredis.Redis, keys: Keys, job: str) -> int:
    """Delete what :func:`publish_progress` and a job's rendezvous wrote for ``job``: its record,
    history, cancel flag, its rendezvous keys, and its entry in ``keys.jobs``. Returns keys deleted."""
    with redis_errors(f"forget progress of job {job}"):
        doomed = [keys.job_progress(job), keys.job_history(job), keys.job_cancel(job)]
        doomed += [k async for k in redis.scan_iter(match=keys.rendezvous_pattern(job), count=500)]
        async with redis.pipeline(transaction=True) as pipe:
            pipe.delete(*doomed)
            pipe.srem(keys.jobs, job)
            deleted, _ = await pipe.execute()
    return int(deleted)

