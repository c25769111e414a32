"""DynamicBatcher alone: what arrives during a forward pass is the next batch, and failures stay put."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from grains.serving.batcher import BatchDone, DynamicBatcher


class Model:
    """Doubles its items; blocks each batch until released, to force what arrives meanwhile."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def run(self, items: Sequence[int]) -> list[int]:
        self.batches.append(list(items))
        await self.gate.wait()
        if -1 in items:
            raise ValueError("poison")
        return [2 * i for i in items]


async def test_requests_arriving_during_a_forward_pass_form_the_next_batch():
    m = Model()
    m.gate.clear()
    done: list[BatchDone] = []
    b = DynamicBatcher(m.run, max_rows=64, on_batch=done.append)
    first = asyncio.ensure_future(b.submit(0, 1))
    await asyncio.sleep(0)  # the first batch starts (a lone request never waits for company)
    rest = [asyncio.ensure_future(b.submit(i, 1)) for i in range(1, 10)]
    await asyncio.sleep(0)
    assert m.batches == [[0]] and b.statistics().queued == 9
    m.gate.set()
    assert await first == 0 and await asyncio.gather(*rest) == [2 * i for i in range(1, 10)]
    assert m.batches == [[0], list(range(1, 10))]
    assert [(d.requests, d.rows, d.failed) for d in done] == [(1, 1, 0), (9, 9, 0)]


async def test_a_batch_holds_at_most_max_rows_and_a_big_request_goes_alone():
    m = Model()
    m.gate.clear()
    b = DynamicBatcher(m.run, max_rows=7)
    blocker = asyncio.ensure_future(b.submit(100, 1))
    await asyncio.sleep(0)
    waiting = [asyncio.ensure_future(b.submit(i, 3)) for i in range(5)] + [asyncio.ensure_future(b.submit(9, 20))]
    await asyncio.sleep(0)
    m.gate.set()
    await asyncio.gather(blocker, *waiting)
    assert m.batches == [[100], [0, 1], [2, 3], [4], [9]]


async def test_a_failing_request_fails_alone_and_the_others_of_its_batch_are_answered():
    m = Model()
    m.gate.clear()
    b = DynamicBatcher(m.run, max_rows=64)
    blocker = asyncio.ensure_future(b.submit(100, 1))
    await asyncio.sleep(0)
    items = [1, -1, 3]
    futs = [asyncio.ensure_future(b.submit(i, 1)) for i in items]
    await asyncio.sleep(0)
    m.gate.set()
    got = await asyncio.gather(blocker, *futs, return_exceptions=True)
    assert got[0] == 200 and got[1] == 2 and got[3] == 6
    assert isinstance(got[2], ValueError)
    assert m.batches[1:] == [[1, -1, 3], [1], [-1], [3]]  # the batch, then request by request


async def test_a_request_whose_caller_gave_up_is_never_run():
    m = Model()
    m.gate.clear()
    b = DynamicBatcher(m.run, max_rows=64)
    blocker = asyncio.ensure_future(b.submit(100, 1))
    await asyncio.sleep(0)
    gone = asyncio.ensure_future(b.submit(5, 1))
    kept = asyncio.ensure_future(b.submit(6, 1))
    await asyncio.sleep(0)
    gone.cancel()
    m.gate.set()
    assert await kept == 12 and await blocker == 200
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert m.batches == [[100], [6]]


async def test_a_delay_lets_a_batch_wait_for_company_until_it_is_full():
    m = Model()
    b = DynamicBatcher(m.run, max_rows=4, max_delay_s=60.0)
    futs = [asyncio.ensure_future(b.submit(i, 1)) for i in range(4)]  # the fourth fills the batch
    assert await asyncio.gather(*futs) == [0, 2, 4, 6]
    assert m.batches == [[0, 1, 2, 3]]


async def test_a_caller_giving_up_during_the_one_by_one_rerun_leaves_the_rest_of_its_batch_answered():
    m = Model()
    m.gate.clear()
    alone = asyncio.Event()  # the poisoned request's own pass waits here, so its caller can leave meanwhile
    entered = asyncio.Event()
    run = m.run

    async def model(items: Sequence[int]) -> list[int]:
        if list(items) == [-1]:
            entered.set()
            await alone.wait()
        return await run(items)

    done: list[BatchDone] = []
    b = DynamicBatcher(model, max_rows=64, on_batch=done.append)
    blocker = asyncio.ensure_future(b.submit(100, 1))
    await asyncio.sleep(0)
    first, gone, last = (asyncio.ensure_future(b.submit(i, 1)) for i in (1, -1, 3))
    await asyncio.sleep(0)
    m.gate.set()
    await entered.wait()
    gone.cancel()  # its deadline passed while its pass ran: the pass then fails into a cancelled future
    await asyncio.sleep(0)
    alone.set()
    assert await blocker == 200 and await first == 2 and await last == 6
    assert gone.cancelled()
    assert m.batches[1:] == [[1, -1, 3], [1], [-1], [3]]
    assert [d.failed for d in done] == [0, 1]


async def test_a_batch_holds_one_key_and_the_oldest_waiting_request_leads_the_next():
    m = Model()
    m.gate.clear()
    b = DynamicBatcher(m.run, max_rows=3)
    blocker = asyncio.ensure_future(b.submit(100, 1, "a"))
    await asyncio.sleep(0)
    # a b a a a b: the "a"s are more, yet "b" leads the batch after the first "a" batch.
    keys = ["a", "b", "a", "a", "a", "b"]
    futs = [asyncio.ensure_future(b.submit(i, 1, k)) for i, k in enumerate(keys)]
    await asyncio.sleep(0)
    m.gate.set()
    assert await asyncio.gather(blocker, *futs) == [200, *(2 * i for i in range(6))]
    assert m.batches == [[100], [0, 2, 3], [1, 5], [4]]
