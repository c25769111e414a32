"""A chat room: one grain fans each message out to its members' grains.

    python samples/chat_room.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grains import Grain, read_only


class User(Grain):
    def __init__(self) -> None:
        self.inbox: list[str] = []

    async def receive(self, room: str, sender: str, text: str) -> None:
        self.inbox.append(f"[{room}] {sender}: {text}")

    @read_only
    async def messages(self) -> list[str]:
        return list(self.inbox)


class ChatRoom(Grain):
    def __init__(self) -> None:
        self.members: list[str] = []

    async def join(self, user: str) -> int:
        if user not in self.members:
            self.members.append(user)
        return len(self.members)

    async def post(self, sender: str, text: str) -> int:
        """Deliver to every member concurrently; returns how many got it."""
        users = [self.get_grain(User, m) for m in self.members]
        await asyncio.gather(*(u.receive(self.key, sender, text) for u in users))
        return len(users)


async def chat(redis_url: str, cluster: str) -> list[str]:
    from silo import ClusterClient

    async with await ClusterClient.connect(redis_url, cluster=cluster) as client:
        room = client.get_grain(ChatRoom, "lobby")
        for name in ("ada", "grace", "linus"):
            await room.join(name)
        await room.post("ada", "hello everyone")
        delivered = await room.post("grace", "hi ada")
        inbox = await client.get_grain(User, "linus").messages()
    print(f"each message went to {delivered} members; linus's inbox:")
    for line in inbox:
        print("  " + line)
    return inbox


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis")
    parser.add_argument("--cluster", default="chat")
    args = parser.parse_args(argv)
    if args.redis:
        asyncio.run(chat(args.redis, args.cluster))
        return 0
    from silo.testing.local import LocalCluster

    with LocalCluster(grains="samples.chat_room", silos=2, cluster=args.cluster) as lc:
        inbox = asyncio.run(chat(lc.redis_url, lc.cluster))
    return 0 if len(inbox) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
