"""Graceful shutdown for `mini-infer serve`: on SIGTERM / SIGINT refuse new requests with a 503, give the open ones
--shutdown-timeout seconds, then end the rest with an error (a final SSE error event + [DONE], or a 503)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

import uvicorn

from mini_infer.engine.async_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)

FLUSH_S = 2.0  # for the aborted requests' last events (and uvicorn's open connections) once the engine stops
_POLL_S = 0.05


class Drain:
    """How many HTTP requests are in flight, and whether new ones are refused."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0

    async def wait_idle(self, timeout: float, interrupted: asyncio.Event) -> None:
        """Return once no request is in flight, after `timeout` seconds, or when `interrupted` is set."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight and not interrupted.is_set() and loop.time() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(interrupted.wait(), min(_POLL_S, max(0.0, deadline - loop.time())))


class DrainMiddleware:
    """ASGI middleware: counts the HTTP requests in flight and, once draining, answers new ones with `refusal()`
    (an ASGI response) without running them."""

    def __init__(self, app, drain: Drain, refusal: Callable) -> None:
        self.app, self.drain, self.refusal = app, drain, refusal

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await self.refusal()(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: they wait for every open stream to end however long it streams, and
    re-raise the signal once uvicorn is done (a traceback for SIGINT). _Signals drives the shutdown instead."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class _Signals:
    """SIGTERM / SIGINT on the event loop: the first sets `first`, any later one sets `again`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, server: uvicorn.Server) -> None:
        self.loop, self.server = loop, server
        self.first, self.again = asyncio.Event(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._received, sig)

    def _received(self, sig: int) -> None:
        if not self.first.is_set():
            logger.info("received %s: shutting down (send it again to skip the wait)", signal.Signals(sig).name)
            self.first.set()
            return
        logger.info("received %s again: aborting the requests still open", signal.Signals(sig).name)
        self.again.set()
        if self.server.should_exit:  # past the drain already: stop waiting on open connections too
            self.server.force_exit = True

    def remove(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.remove_signal_handler(sig)


def serve(app, engine: AsyncLLMEngine, *, host: str, port: int, log_level: str, shutdown_timeout: float) -> None:
    """Serve `app` (from build_app, over `engine`) until SIGTERM / SIGINT, then drain and shut `engine` down."""
    asyncio.run(_serve(app, engine, uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                   timeout_graceful_shutdown=FLUSH_S), shutdown_timeout))


async def _serve(app, engine: AsyncLLMEngine, config: uvicorn.Config, shutdown_timeout: float) -> None:
    server = _Uvicorn(config)
    signals = _Signals(asyncio.get_running_loop(), server)
    try:
        serving = asyncio.ensure_future(server.serve())
        signalled = asyncio.ensure_future(signals.first.wait())
        await asyncio.wait({serving, signalled}, return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        if not serving.done():
            await _shut_down(app.state.drain, engine, shutdown_timeout, signals)
            server.should_exit = True
        await serving
    finally:
        signals.remove()


async def _shut_down(drain: Drain, engine: AsyncLLMEngine, timeout: float, signals: _Signals) -> None:
    drain.draining = True
    if drain.in_flight:
        logger.info("%d request(s) in flight: waiting up to %.1f s for them", drain.in_flight, timeout)
    await drain.wait_idle(timeout, signals.again)
    if drain.in_flight:
        logger.info("aborting %d request(s) still in flight", drain.in_flight)
    # Fails every open stream with EngineShutdownError, which the app turns into its last event or a 503.
    await asyncio.to_thread(engine.shutdown)
    await drain.wait_idle(FLUSH_S, signals.again)
