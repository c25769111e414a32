"""Bank accounts with transfers between grains; the total balance never changes.

Each transfer is its own grain (a saga): it persists its stage, withdraws and
deposits with idempotent, transaction-id-keyed operations, and can be re-run
after any failure until it reports done. Run it end to end, with silos being
killed while transfers run::

    python samples/bank.py --accounts 10 --transfers 200 --kills 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pydantic import BaseModel, Field

from grains import Grain

INITIAL_BALANCE = 1_000


class Account(Grain):
    class State(BaseModel):
        balance: int = INITIAL_BALANCE
        applied: dict[str, int] = Field(default_factory=dict)
        """Transaction id -> signed amount applied (makes retries harmless)."""

    async def withdraw(self, tx: str, amount: int) -> bool:
        if tx in self.state.applied:
            return self.state.applied[tx] != 0
        ok = self.state.balance >= amount
        self.state.applied[tx] = -amount if ok else 0
        if ok:
            self.state.balance -= amount
        await self.write_state()
        return ok

    async def deposit(self, tx: str, amount: int) -> None:
        if tx in self.state.applied:
            return
        self.state.applied[tx] = amount
        self.state.balance += amount
        await self.write_state()

    async def balance(self) -> int:
        return self.state.balance


class Transfer(Grain):
    """One transfer; ``run`` is safe to call again after any failure."""

    class State(BaseModel):
        source: str = ""
        target: str = ""
        amount: int = 0
        stage: str = "new"  # new -> withdrawn | rejected -> done

    async def run(self, source: str, target: str, amount: int) -> str:
        s = self.state
        if s.stage == "new":
            s.source, s.target, s.amount = source, target, amount
            ok = await self.get_grain(Account, source).withdraw(self.key, amount)
            s.stage = "withdrawn" if ok else "rejected"
            await self.write_state()
        if s.stage == "withdrawn":
            await self.get_grain(Account, s.target).deposit(self.key, s.amount)
            s.stage = "done"
            await self.write_state()
        return s.stage


async def run_transfers(
    redis_url: str, cluster: str, accounts: int, transfers: int, on_progress: object = None, seed: int = 7
) -> int:
    from silo import ClusterClient, errors

    rng = random.Random(seed)
    async with await ClusterClient.connect(redis_url, cluster=cluster) as client:
        async def one(i: int) -> None:
            a, b = rng.sample(range(accounts), 2)
            tx = client.get_grain(Transfer, f"tx-{i}")
            for _ in range(200):
                try:
                    await tx.with_timeout(10).run(f"acct-{a}", f"acct-{b}", rng.randint(1, 300))
                    return
                except (errors.SiloError, errors.GrainTimeoutError, errors.GrainDeactivatedError, errors.StorageError):
                    await asyncio.sleep(0.1)  # a silo died under us: run the saga again
            raise RuntimeError(f"transfer {i} never completed")

        batch = 20
        for start in range(0, transfers, batch):
            await asyncio.gather(*(one(i) for i in range(start, min(transfers, start + batch))))
            if callable(on_progress):
                on_progress(min(transfers, start + batch))
        balances = await asyncio.gather(*(client.get_grain(Account, f"acct-{i}").balance() for i in range(accounts)))
    total = sum(balances)
    print(f"{transfers} transfers between {accounts} accounts; total balance {total} (expected {accounts * INITIAL_BALANCE})")
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis")
    parser.add_argument("--cluster", default="bank")
    parser.add_argument("--accounts", type=int, default=10)
    parser.add_argument("--transfers", type=int, default=200)
    parser.add_argument("--kills", type=int, default=1, help="silos to SIGKILL (and restart) while transfers run")
    args = parser.parse_args(argv)
    if args.redis:
        total = asyncio.run(run_transfers(args.redis, args.cluster, args.accounts, args.transfers))
        return 0 if total == args.accounts * INITIAL_BALANCE else 1
    from silo.testing.local import LocalCluster

    with LocalCluster(grains="samples.bank", silos=3, cluster=args.cluster) as lc:
        kill_at = {round(args.transfers * (k + 1) / (args.kills + 1)) // 20 * 20 for k in range(args.kills)}

        def progress(done: int) -> None:
            if done in kill_at:
                victim = lc.silos[done % len(lc.silos)]
                print(f"after {done} transfers: SIGKILL silo {victim.address}", flush=True)
                victim.kill()
                victim.start()

        total = asyncio.run(run_transfers(lc.redis_url, lc.cluster, args.accounts, args.transfers, progress))
    return 0 if total == args.accounts * INITIAL_BALANCE else 1


if __name__ == "__main__":
    sys.exit(main())
