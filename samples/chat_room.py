"""A chat room on streams and observers: messages go down a stream, presence is pushed to members.

    python samples/chat_room.py

Nothing fans out by polling. Posting publishes one message to stream
``("chat", room)``: each member reading the room holds an explicit subscription
(live, in order, resumable from a token), and ``RoomHistory``, implicitly
subscribed to namespace ``chat``, is activated per room and gets every message
as a turn (at least once, in order, acknowledged after the turn), keeping the
room's recent history in its persisted state.

Presence goes by observer, pushed by the room: a member joins with a reference
to a local ``Member`` object (``await client.observer(member)``), and the room
keeps the references in an ``ObserverSet`` and calls them back, on
``on_joined`` and ``on_left`` of the others and ``on_mentioned`` when a message
names them (``@name``). A member stays present by joining again within
``PRESENCE_S`` (which renews its entry); one whose client closed without
leaving is found gone at the next notification, dropped, and announced as left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pydantic import BaseModel

from grains import Grain, ObserverRef, ObserverSet, read_only, subscribes
from grains.streams import Subscription, token_order

HISTORY = 100
"""Lines of history a room keeps."""
PRESENCE_S = 60.0
"""A member that does not join again within this long is no longer present."""


class ChatMessage(BaseModel):
    room: str
    sender: str
    text: str

    def line(self) -> str:
        return f"[{self.room}] {self.sender}: {self.text}"


class Member:
    """A member's side of presence: the room calls these through an observer reference."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.told: list[str] = []

    async def on_joined(self, user: str) -> None:
        self.told.append(f"{user} joined")

    async def on_left(self, user: str) -> None:
        self.told.append(f"{user} left")

    async def on_mentioned(self, sender: str, text: str) -> None:
        self.told.append(f"{sender} mentioned you: {text}")


class ChatRoom(Grain):
    class State(BaseModel):
        members: list[str] = []
        """Everyone who ever joined (may post); who is present now is in memory, below."""

    def __init__(self) -> None:
        # In memory: after a deactivation the set is empty until members join (renew) again.
        self.present = ObserverSet(expiry_s=PRESENCE_S)
        self.names: dict[ObserverRef, str] = {}

    async def join(self, user: str, member: ObserverRef) -> None:
        """Be present (the others are told), or, with the same reference, stay present."""
        if member not in self.present:
            await self._tell("on_joined", user)
        self.present.subscribe(member)
        self.names[member] = user
        if user not in self.state.members:
            self.state.members.append(user)
            await self.write_state()

    async def leave(self, user: str, member: ObserverRef) -> None:
        if self.present.unsubscribe(member):
            del self.names[member]
            await self._tell("on_left", user)

    @read_only
    async def here(self) -> list[str]:
        return sorted(self.names[m] for m in self.present)

    async def post(self, sender: str, text: str) -> str:
        """Publish to the room's stream (returns the message's token); tell whoever it mentions."""
        if sender not in self.state.members:
            raise ValueError(f"{sender} has not joined {self.key}")
        token = await self.stream("chat", self.key).publish(ChatMessage(room=self.key, sender=sender, text=text))
        for user in {m for m in self.names.values() if f"@{m}" in text}:
            await self._tell("on_mentioned", sender, text, only=user)
        return token

    async def _tell(self, method: str, *args: str, only: str | None = None) -> None:
        """Call ``method`` on the present members (or on ``only``), all at once. One found gone
        (its client closed without leaving) is dropped by the set: the others are told it left."""

        async def call(member: ObserverRef) -> None:
            if only is None or self.names[member] == only:
                await getattr(member, method)(*args)

        result = await self.present.notify(call)
        gone = [self.names[m] for m in result.gone]
        self.names = {m: self.names[m] for m in self.present}  # also forgets the expired
        for user in gone:
            await self._tell("on_left", user)


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


async def read(sub: Subscription, n: int) -> list[str]:
    got = []
    async for ev in sub:
        got.append(ev.item.line())
        if len(got) == n:
            break
    return got


async def chat(redis_url: str, cluster: str) -> list[str]:
    from silo import ClusterClient

    async def connect() -> ClusterClient:
        return await ClusterClient.connect(redis_url, cluster=cluster, types=[ChatMessage])

    members = {name: Member(name) for name in ("ada", "grace", "linus")}
    async with await connect() as client:
        room = client.get_grain(ChatRoom, "lobby")
        # linus runs his own client (his own process, as it were), which he closes without leaving.
        async with await connect() as linus_client, contextlib.AsyncExitStack() as stack:
            clients = {name: linus_client if name == "linus" else client for name in members}
            refs = {}
            # Each joins through its own client: a client's observer is called over that client's connections.
            for name, member in members.items():
                refs[name] = await clients[name].observer(member)
                await clients[name].get_grain(ChatRoom, "lobby").join(name, refs[name])
            await room.join("ada", refs["ada"])  # renews ada's presence: nobody is told again
            # Each member's subscription starts now (entering it pins the position).
            subs = {
                name: await stack.enter_async_context(clients[name].stream("chat", "lobby").subscribe())
                for name in members
            }
            readers = {name: asyncio.create_task(read(sub, 2)) for name, sub in subs.items()}
            await room.post("ada", "hello everyone")
            await room.post("grace", "hi ada, and @linus")
            inboxes = {name: await asyncio.wait_for(t, 30) for name, t in readers.items()}
        await room.leave("grace", refs["grace"])  # ada is told; linus's client is found gone
        here = await room.here()
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
    print("what the room told each member (ChatRoom -> ObserverSet -> the member's client):")
    for name, member in members.items():
        print(f"  {name}: {'; '.join(member.told)}")
    print(f"present now: {', '.join(here)}")
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
