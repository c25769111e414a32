"""Running the dashboard: in the caller's event loop, or in a thread of its own."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

from dashboard.app import create_app


class _Server(uvicorn.Server):
    """uvicorn's server minus its signal handling: the caller (a silo, the CLI) owns signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_server(
    redis_url: str,
    cluster: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    admin_token: str | None = None,
    poll_ms: int = 1000,
) -> uvicorn.Server:
    app = create_app(redis_url, cluster, admin_token=admin_token, poll_ms=poll_ms)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="on"
    )
    return _Server(config)


async def serve(server: uvicorn.Server) -> None:
    """Serve until ``server.should_exit`` is set (``redgrain dashboard``, ``redgrain silo --dashboard``)."""
    await server.serve()


class DashboardThread:
    """The dashboard on its own event loop in a daemon thread (tests, benchmarks, embedding)."""

    def __init__(
        self, redis_url: str, cluster: str, *, port: int, admin_token: str | None = None
    ) -> None:
        self.server = make_server(redis_url, cluster, port=port, admin_token=admin_token)
        self.url = f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self._run, name="redgrain-dashboard", daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve())

    def start(self, timeout_s: float = 20.0) -> DashboardThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:  # uvicorn sets a plain flag; nothing to await across threads
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("dashboard server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(RuntimeError):
            self._thread.join(10)

    def __enter__(self) -> DashboardThread:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
