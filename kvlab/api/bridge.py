"""The serving engine's loop in one background thread, fed from asyncio.

Every engine call (``add``, ``abort``, ``step``, ``stats``) happens on that thread, so the engine
needs no locks. The asyncio side puts commands in an inbox and wakes the thread; each step's token
events go back in one ``call_soon_threadsafe`` to per-request asyncio queues. A request whose
client left is aborted (its blocks freed) and its late events are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass

from kvlab.errors import UserError
from kvlab.serve.engine import Request, TokenEvent

log = logging.getLogger("kvlab.api")

IDLE_WAIT_S = 0.05  # an idle loop re-checks its inbox at least this often


@dataclass
class EngineFailure:
    """Put on a request's queue when the engine raised while it ran: the request ends in a 500."""

    message: str


class EngineLoop:
    """Runs ``engine.step()`` while there is work; ``submit`` and ``abort`` from the event loop."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.loop = loop
        self.stats: dict = dict(engine.stats())  # the last snapshot, read by /metrics
        self.steps = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}  # touched on the event loop only
        self._thread = threading.Thread(target=self._run, name="kvlab-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    async def submit(self, request: Request) -> asyncio.Queue:
        """Queue ``request`` on the engine; its events arrive on the returned queue. Raises the
        engine's ``UserError`` if the request can never run."""
        events: asyncio.Queue = asyncio.Queue()
        accepted = self.loop.create_future()
        self._streams[request.request_id] = events
        self._send(("add", request, accepted))
        try:
            await accepted
        except BaseException:
            self._streams.pop(request.request_id, None)
            if not accepted.done() or accepted.cancelled():  # cancelled while queued: take it back
                self._send(("abort", request.request_id, None))
            raise
        return events

    def abort(self, request_id: str) -> None:
        """Free a request's blocks; its queue gets nothing more."""
        if self._streams.pop(request_id, None) is not None:
            self._send(("abort", request_id, None))

    def _send(self, command) -> None:
        self._inbox.put(command)
        self._wake.set()

    # --- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._drain_inbox()
            if not self.engine.has_work():
                self._wake.wait(IDLE_WAIT_S)
                continue
            try:
                events = self.engine.step()
            except Exception as err:  # a bug in the engine: fail what runs, keep serving
                log.exception("engine step failed")
                self.loop.call_soon_threadsafe(self._fail_streams, f"the engine failed: {type(err).__name__}: {err}")
                self._wake.wait(IDLE_WAIT_S)  # the aborts arrive through the inbox
                continue
            self.steps += 1
            self.stats = dict(self.engine.stats())
            if events:
                self.loop.call_soon_threadsafe(self._deliver, events)

    def _drain_inbox(self) -> None:
        changed = False
        while True:
            try:
                op, arg, future = self._inbox.get_nowait()
            except queue.Empty:
                break
            changed = True
            if op == "add":
                self._add(arg, future)
            else:
                self._abort(arg)
        if changed:
            self.stats = dict(self.engine.stats())

    def _add(self, request: Request, future: asyncio.Future) -> None:
        try:
            self.engine.add(request)
        except Exception as err:
            if not isinstance(err, UserError):
                log.exception("engine.add failed")
            self.loop.call_soon_threadsafe(_settle, future, err)
            return
        self.loop.call_soon_threadsafe(_settle, future, None)

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # an id the engine already finished: nothing to free
            log.debug("abort of %s", request_id, exc_info=True)

    # --- the event loop ------------------------------------------------------------------------
    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:
                continue  # aborted: late events are dropped
            stream.put_nowait(event)
            if event.finished:
                del self._streams[event.request_id]

    def _fail_streams(self, message: str) -> None:
        """Every running request ends with ``message``, and the engine frees its blocks."""
        for request_id, stream in list(self._streams.items()):
            stream.put_nowait(EngineFailure(message))
            self.abort(request_id)


def _settle(future: asyncio.Future, err: BaseException | None) -> None:
    if future.done():
        return
    if err is None:
        future.set_result(None)
    else:
        future.set_exception(err)
