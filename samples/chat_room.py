"""A chat room on streams: a room is a stream; readers subscribe, a grain keeps the history.

    python samples/chat_room.py

Posting publishes one message to stream ``("chat", room)``; nothing fans out and
nobody polls. Each member reading the room holds an explicit subscription (live,
in order, resumable from a token), and ``RoomHistory``, implicitly subscribed to
namespace ``chat``, is activated per room and gets every message as a turn (at
least once, in order, acknowledged after the turn), keeping the room's recent
history in its persisted state.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pydantic import BaseModel

from grains import Grain, read_only, subscribes
from grains.streams import Subscription, token_order

HISTORY = 100
"""Lines of history a room keeps."""


class ChatMessage(BaseModel):
    room: str
    sender: str
    text: str

    def line(self) -> str:
        return f"[{self.room}] {self.sender}: {self.text}"


class ChatRoom(Grain):
    class State(BaseModel):
        members: list[str] = []

    async def join(self, user: str) -> int:
        if user not in self.state.members:
            self.state.members.append(user)
            await self.write_state()
        return len(self.state.members)

    @read_only
    async def members(self) -> list[str]:
        return list(self.state.members)

    async def post(self, sender: str, text: str) -> str:
        """Publish to the room's stream; returns the message's token."""
        if sender not in self.state.members:
            raise ValueError(f"{sender} has not joined {self.key}")
        return await self.stream("chat", self.key).publish(ChatMessage(room=self.key, sender=sender, text=text))


@subscribes("chat")
class RoomHistory(Grain):
    """One per room (its key is the room's): the room's last messages, persisted."""

    class State(BaseModel):
        lines: list[str] = []
        last_token: str = "0-0"

    async def on_stream_item(self, item: ChatMessage, token: str) -> None:
        if token_order(token) <= token_order(self.state.last_token):
            return  # delivered again after a silo died before acknowledging it
        self.state.lines = [*self.state.lines, item.line()][-HISTORY:]
        self.state.last_token = token
        await self.write_state()

    @read_only
    async def recent(self) -> list[str]:
        return list(self.state.lines)


async def chat(redis_url: str, cluster: str) -> list[str]:
    from silo import ClusterClient

    async with await ClusterClient.connect(redis_url, cluster=cluster, types=[ChatMessage]) as client:
        room = client.get_grain(ChatRoom, "lobby")
        for name in ("ada", "grace", "linus"):
            await room.join(name)
        async with contextlib.AsyncExitStack() as stack:
            # Each member's subscription starts now (entering it pins the position).
            subs = {m: await stack.enter_async_context(client.stream("chat", "lobby").subscribe()) for m in await room.members()}

            async def read(sub: Subscription, n: int) -> list[str]:
                got = []
                async for ev in sub:
                    got.append(ev.item.line())
                    if len(got) == n:
                        break
                return got

            readers = {m: asyncio.create_task(read(sub, 2)) for m, sub in subs.items()}
            await room.post("ada", "hello everyone")
            await room.post("grace", "hi ada")
            inboxes = {m: await asyncio.wait_for(t, 30) for m, t in readers.items()}
        history = client.get_grain(RoomHistory, "lobby")
        async with asyncio.timeout(30):  # the history grain is delivered to by the silos, on their own
            while len(await history.recent()) < 2:
                await asyncio.sleep(0.1)
        lines = await history.recent()
    delivered = sum(inbox == inboxes["ada"] for inbox in inboxes.values())  # all read the same, in order
    print(f"each message went to {delivered} members; linus read from the stream:")
    for line in inboxes["linus"]:
        print("  " + line)
    print(f"the room's history (RoomHistory, fed by its implicit subscription): {len(lines)} lines")
    return inboxes["linus"]


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
