"""Continuous batching: one worker thread owns a :class:`runtime.engine.SpecEngine` and steps every running request
together; asyncio handlers submit requests and read their tokens as they are emitted.

- Admission: up to ``max_running`` sequences share each engine step; up to ``max_waiting`` more wait in FIFO order
  and join the batch as soon as a slot frees (between two steps). Beyond that :meth:`AsyncEngine.submit` raises
  :class:`QueueFull` (the server answers 429 with Retry-After).
- Abort: :meth:`RequestStream.abort` (a client that disconnected) removes the request before the next step; its
  slot and caches are freed at once (``SpecEngine.abort``) and the other rows are not touched.
- Thread safety: only the worker thread touches the engine; handlers talk to it through a command queue, and the
  worker hands events back with ``loop.call_soon_threadsafe``.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable

from runtime.engine import GenerationResult, SpecEngine
from runtime.sampling import SamplingParams, TokenLogprob

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """All running slots and waiting places are taken; retry after ``retry_after_s``."""

    def __init__(self, taken: int, max_running: int, max_waiting: int, needed: int = 1, retry_after_s: int = 1):
        super().__init__(f"server is at capacity: {taken} of {max_running + max_waiting} places taken "
                         f"({max_running} running + {max_waiting} waiting), this request needs {needed}; retry later")
        self.retry_after_s = retry_after_s


class EngineFailed(RuntimeError):
    """The engine raised while stepping this request (the request is aborted; the server keeps serving)."""


@dataclasses.dataclass(slots=True)
class StepEvent:
    token_ids: list[int]  # tokens emitted by this step (may be several: accepted drafts + bonus)
    result: GenerationResult | None = None  # set on the last event
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of ``token_ids`` when the request asked


class RequestStream:
    """Handle of one submitted request: ``async for event in stream`` yields :class:`StepEvent` until the result."""

    def __init__(self, request_id: str, engine: "AsyncEngine", loop: asyncio.AbstractEventLoop | None,
                 callback: Callable[[StepEvent], None] | None = None):
        self.request_id = request_id
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self._engine = engine
        self._loop = loop
        self._callback = callback
        self._queue: asyncio.Queue[StepEvent] | None = asyncio.Queue() if callback is None else None
        self.finished = False

    def _push(self, event: StepEvent) -> None:  # worker thread
        if self._callback is not None:  # threaded callers (Triton's Python backend): called on the worker
            if event.token_ids and self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self._callback(event)
        else:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def next_event(self, timeout: float | None = None) -> StepEvent | None:
        """The next event, or None after ``timeout`` seconds without one."""
        try:
            event = await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if event.token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if event.result is not None or event.error is not None:
            self.finished = True
        return event

    def __aiter__(self):
        return self

    async def __anext__(self) -> StepEvent:
        if self.finished:
            raise StopAsyncIteration
        return await self.next_event()

    def abort(self) -> None:
        """Drop the request (client gone); safe to call more than once or after it finished."""
        if not self.finished:
            self.finished = True
            self._engine._commands.put(("abort", self.request_id))
            self._engine._wake.set()


class AsyncEngine:
    """Runs ``engine`` on a worker thread with continuous batching (module docstring).

    Args:
        engine: the engine (owned by the worker from :meth:`start` on).
        max_running: sequences per engine step.
        max_waiting: queued requests beyond the running ones before :class:`QueueFull`.
        on_step: called on the worker after every step with ``(outputs, step_seconds)`` (metrics).
    """

    def __init__(self, engine: SpecEngine, max_running: int = 8, max_waiting: int = 64,
                 on_step: Callable[[list, float], None] | None = None):
        if max_running < 1 or max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        self.engine = engine
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiting: collections.deque[tuple[RequestStream, list[int], SamplingParams, str | None]] = \
            collections.deque()
        self._streams: dict[str, RequestStream] = {}
        self._pending = 0  # submitted, not yet finished (admission control; touched under _lock)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="sharpdraft-engine", daemon=True)

    # ------------------------------------------------------------ handler side
    def start(self) -> None:
        """Start the worker. Raises RuntimeError if another live AsyncEngine already drives this engine."""
        owner = getattr(self.engine, "_async_owner", None)
        if owner is not None and owner is not self and owner._thread.is_alive():
            raise RuntimeError("this SpecEngine is already driven by another running AsyncEngine (one worker per "
                               "engine: the engine is not thread-safe)")
        self.engine._async_owner = self
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if getattr(self.engine, "_async_owner", None) is self:
            self.engine._async_owner = None

    @property
    def num_running(self) -> int:
        return len(self.engine.sequences)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               callback: Callable[[StepEvent], None] | None = None) -> RequestStream:
        """Queue a request: from the event loop (events arrive through the returned stream), or from any thread
        with ``callback`` (called on the worker thread with every :class:`StepEvent`; it must not block).

        Raises:
            QueueFull: max_running + max_waiting requests are already in the system.
            ValueError: the request is invalid (see :meth:`SpecEngine.check_request`); nothing is queued.
        """
        return self.submit_group(prompt_ids, [params], callback)[0]

    def submit_group(self, prompt_ids: list[int], params: list[SamplingParams],
                     callback: Callable[[StepEvent], None] | None = None) -> list[RequestStream]:
        """Queue ``len(params)`` requests on one prompt (the n choices of one OpenAI request), all or none; those
        admitted in the same step share one prefill (``SpecEngine.add_request(prefill_group=...)``).

        Raises:
            QueueFull: fewer than ``len(params)`` places are left.
            ValueError: a request is invalid; nothing is queued.
        """
        for p in params:
            self.engine.check_request(prompt_ids, p)
        loop = asyncio.get_running_loop() if callback is None else None
        with self._lock:
            if self._pending + len(params) > self.max_running + self.max_waiting:
                # counted from admissions, not from the engine's state, which lags the commands just queued
                raise QueueFull(self._pending, self.max_running, self.max_waiting, len(params))
            self._pending += len(params)
        group = f"group-{next(self._ids)}" if len(params) > 1 else None
        streams = [RequestStream(f"req-{next(self._ids)}", self, loop, callback) for _ in params]
        for stream, p in zip(streams, params):
            self._commands.put(("add", (stream, list(prompt_ids), p, group)))
        self._wake.set()
        return streams

    # ------------------------------------------------------------ worker side
    def _done(self, stream: RequestStream, event: StepEvent) -> None:
        self._streams.pop(stream.request_id, None)
        with self._lock:
            self._pending -= 1
        stream._push(event)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._waiting.append(payload)
            elif kind == "abort":
                stream = self._streams.get(payload)
                if stream is not None:
                    self.engine.abort(payload)
                    self._done(stream, StepEvent([], error="aborted"))
                else:  # still waiting: drop it from the queue
                    for item in list(self._waiting):
                        if item[0].request_id == payload:
                            self._waiting.remove(item)
                            with self._lock:
                                self._pending -= 1

    def _admit(self) -> None:
        while self._waiting and len(self.engine.sequences) < self.max_running:
            stream, prompt_ids, params, group = self._waiting.popleft()
            try:
                self.engine.add_request(prompt_ids, params, request_id=stream.request_id, prefill_group=group)
            except ValueError as e:  # re-validated on the worker; should have been caught at submit
                self._done(stream, StepEvent([], error=str(e)))
                continue
            self._streams[stream.request_id] = stream

    def _run(self) -> None:
        while not self._stop:
            self._drain_commands()
            self._admit()
            if not self.engine.sequences:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail the requests of this step, keep serving
                log.exception("engine step failed")
                for request_id in list(self.engine.sequences):
                    self.engine.abort(request_id)
                    stream = self._streams.get(request_id)
                    if stream is not None:
                        self._done(stream, StepEvent([], error=f"engine error: {e}"))
                continue
            dt = time.perf_counter() - t0
            for seq, tokens in outputs:
                stream = self._streams.get(seq.request_id)
                if stream is None:
                    continue
                lps = None if seq.token_logprobs is None or not tokens else seq.token_logprobs[-len(tokens):]
                if seq.finished:
                    self._done(stream, StepEvent(tokens, result=seq.result(), logprobs=lps))
                else:
                    stream._push(StepEvent(tokens, logprobs=lps))
            if self.on_step is not None:
                try:
                    self.on_step(outputs, dt)
                except Exception:  # noqa: BLE001 - metrics never break serving
                    log.exception("on_step callback failed")

    def stats(self) -> dict[str, Any]:
        return {"running": self.num_running, "waiting": self.num_waiting, "max_running": self.max_running,
                "max_waiting": self.max_waiting}
