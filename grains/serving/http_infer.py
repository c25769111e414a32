"""The infer route as a bare ASGI handler: the one path per request that must be lean.

``POST /v2/models/{name}[/versions/{v}]/infer`` is served here, ahead of the
FastAPI app that answers every other path (:func:`grains.serving.http.create_app`
puts it in front). Through FastAPI's routing, dependency solving and
middleware stack the same request cost about a fifth of the front's CPU
(docs/serving.md, "Where the HTTP time goes"); here it is a string split, the
body read from ``receive``, one grain call and one response event carrying
the whole body. Statuses and error bodies are those of the rest of the front.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from grains.serving import oip
from grains.serving.errors import BadInputError, RequestTooLargeError
from grains.serving.front import Front, failure

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_JSON = [(b"content-type", oip.JSON_TYPE.encode())]
_HEADER = oip.HEADER.lower().encode()


def model_of(path: str) -> str | None:
    """The model an infer path names, or None when ``path`` is not an infer path."""
    parts = path.split("/")
    # "", "v2", "models", name, "infer"  or  "", "v2", "models", name, "versions", v, "infer"
    shaped = len(parts) == 5 or len(parts) == 7 and parts[4] == "versions"
    if shaped and parts[1] == "v2" and parts[2] == "models" and parts[-1] == "infer" and parts[3]:
        return parts[3]
    return None


class InferRoute:
    """Answers infer requests for ``front``; counts each answer's status in ``counts``."""

    def __init__(self, front: Front, counts: dict[tuple[str, str], int], max_body_bytes: int) -> None:
        self.front = front
        self.counts = counts
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send, model: str) -> None:
        status, headers, payload = await self._answer(scope, receive, model)
        key = (model, str(status))
        self.counts[key] = self.counts.get(key, 0) + 1
        headers.append((b"content-length", str(len(payload)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    async def _answer(self, scope: Scope, receive: Receive, model: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        try:
            declared: bytes | None = None
            header: bytes | None = None
            for k, v in scope["headers"]:
                if k == b"content-length":
                    declared = v
                elif k == _HEADER:
                    header = v
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                raise RequestTooLargeError(f"body of {declared.decode()} bytes; this server takes at most {self.max_body_bytes}")
            body = await self._body(receive)
            header_length = None
            if header is not None:
                if not header.strip().isdigit():
                    raise BadInputError(f"{oip.HEADER} is not a number: {header.decode(errors='replace')!r}")
                header_length = int(header)
            req, tensors = oip.decode_request(body, header_length)
            got = await self.front.infer(model, tensors)
            payload, json_length = oip.encode_response(req, model, got.version, got.outputs)
        except Exception as exc:
            f = failure(exc)
            if f is None:
                raise
            return f.status, list(_JSON), orjson.dumps({"error": f.message})
        if json_length is None:
            return 200, list(_JSON), payload
        return 200, [(b"content-type", oip.BINARY_TYPE.encode()), (_HEADER, str(json_length).encode())], payload

    async def _body(self, receive: Receive) -> bytes:
        first = await receive()
        body = first.get("body", b"")
        if len(body) > self.max_body_bytes:
            raise RequestTooLargeError(f"body over {self.max_body_bytes} bytes; this server takes at most that")
        if not first.get("more_body", False):
            return body  # the common case: one event, no copy
        chunks, size = [body], len(body)
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise BadInputError("the client went away before sending the whole body")
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise RequestTooLargeError(f"body over {self.max_body_bytes} bytes; this server takes at most that")
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)
