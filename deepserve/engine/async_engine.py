"""AsyncLLMEngine: an asyncio front over one LLMEngine, driven by one dedicated thread.

    asyncio side (any number of coroutines)           engine thread (exactly one)
    generate() ── PendingAdd ──► commands queue ──►  engine.add_request / abort_request
                                                      engine.step() while there is work
    per-request RequestStream ◄── call_soon_threadsafe ◄── RequestOutputs of that step

`AsyncEngineFront` is the asyncio side, shared with the engine-process client (engine/engine_client.py, the
server's default), which drives an LLMEngine in a child process instead of a thread.

Invariants (both drivers):
- every LLMEngine call happens on the engine thread (the engine is not thread-safe); coroutines reach it
  only through `_commands`, and read engine statistics only through the `stats` snapshot;
- commands are applied in the order they were queued, so an abort queued after an add always finds the
  request (or the add's error) in place;
- a request's stream ends exactly once: with its finished output, an exception, or an abort;
- a stream whose consumer goes away (the generator is closed or its task cancelled, e.g. because the
  HTTP client disconnected) aborts its request, which frees its KV blocks at the next engine iteration;
- `num_waiting` counts requests accepted here whose first output has not arrived yet (not yet scheduled);
  it is touched only on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from deepserve.engine.engine import EngineStats, LLMEngine, Prompt
from deepserve.outputs import RequestOutput
from deepserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop died (a step raised); no request can be served any more."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down and takes no new requests (or dropped this one without draining)."""


class QueueFullError(RuntimeError):
    """Too many requests are already waiting to be scheduled."""


class RequestAbortedError(RuntimeError):
    """The request was aborted through `AsyncLLMEngine.abort` while someone was still reading it."""


class StepObserver(Protocol):
    """Sees every step's outputs (e.g. Prometheus metrics), always from one thread: the engine thread, or with the
    engine process the event loop's thread. Must be quick and not raise."""

    def on_step(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> None: ...

    def on_abort(self, request_ids: list[str]) -> None: ...


class RequestStream:
    """One request's outputs, in order, ending with the finished one. `aclose()` aborts it if unfinished.

    Filled on `loop`'s thread (`put`; the engine thread goes through `put_threadsafe`), read by one coroutine.
    Outputs are cumulative, so an output the reader has not taken yet is replaced by the next one: a reader
    slower than the engine (a busy front, a slow client) gets fewer, bigger increments instead of a backlog.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 on_first_item: Callable[[], None], on_close: Callable[[RequestStream], None]) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False           # the engine will send nothing more (set on the loop thread)
        self._items: deque[RequestOutput | BaseException] = deque()
        self._waiter: asyncio.Future | None = None
        self._got_first = False
        self._closed = False
        self._on_first_item = on_first_item
        self._on_close = on_close

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self._close()
            raise item
        if item.finished:
            self._close()
        return item

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._on_close(self)

    def put_threadsafe(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.put, item)
        except RuntimeError:
            pass    # the event loop is closed: nobody is left to read this stream

    def put(self, item: RequestOutput | BaseException) -> None:
        """Deliver an item (event loop thread only); nothing is delivered after the last one."""
        if self.finished:
            return
        if not self._got_first:
            self._got_first = True
            self._on_first_item()
        if isinstance(item, BaseException) or item.finished:
            self.finished = True
        if self._items and isinstance(item, RequestOutput) and isinstance(self._items[-1], RequestOutput):
            self._items[-1] = item      # cumulative: the newer output holds everything the older one did
        else:
            self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


@dataclass
class PendingAdd:
    """A request on its way to the engine; `accepted` resolves once the engine took it (or refused it)."""

    stream: RequestStream
    prompt: Prompt
    params: SamplingParams
    arrival_time: float
    accepted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _AbortRequests:
    request_ids: list[str]


@dataclass
class _Stop:
    drain: bool


class AsyncEngineFront:
    """The asyncio side of an engine driver: admission, per-request streams, `num_waiting`, aborts on close.

    A driver (a subclass) delivers commands to its engine (`_queue_add`, `_queue_abort`, `_queue_stop`), resolves
    each PendingAdd's `accepted`, puts outputs into the streams, keeps `stats` current, and once its engine loop
    has ended sets `_loop_exited` (under `_admission_lock`) and `_loop_done`.
    """

    def __init__(self, max_waiting: int | None = None, observer: StepObserver | None = None) -> None:
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be None or >= 0, got {max_waiting}")
        self.max_waiting = max_waiting
        self.observer = observer
        self.num_waiting = 0
        self._accepting = True
        self._dead: BaseException | None = None
        # Held while queueing an add and while the loop exits, so no add is queued that nobody answers.
        self._admission_lock = threading.Lock()
        self._loop_exited = False
        self._loop_done = threading.Event()
        self._front_streams: dict[str, RequestStream] = {}     # owned by the event loop's thread
        self.stats: EngineStats

    @property
    def tokenizer(self):
        raise NotImplementedError

    def _notify_observer(self, method: str, *args) -> None:
        """Call the observer (on whichever thread delivers the step); its failure is logged, never raised."""
        if self.observer is None:
            return
        try:
            getattr(self.observer, method)(*args)
        except Exception:
            logger.exception("step observer failed in %s", method)

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._loop_exited

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.is_running

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until the finished one.

        Raises ValueError for a bad prompt or params (from LLMEngine.add_request), QueueFullError,
        EngineShutdownError or EngineDeadError. Closing the generator early aborts the request.
        """
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        """Queue a request and wait until the engine took it; the caller must `aclose()` the stream.

        Two-phase form of `generate` for servers: input errors surface here, before any response starts.
        """
        arrival = time.monotonic() if arrival_time is None else arrival_time
        stream, add = self._admit(request_id, prompt, params, arrival)
        try:
            await asyncio.wrap_future(add.accepted)
        except BaseException:
            await stream.aclose()
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request now (its KV blocks are freed at the next engine iteration)."""
        stream = self._front_streams.get(request_id)
        self._queue_abort([request_id])
        if stream is not None:
            stream.put(RequestAbortedError(f"request {request_id!r} was aborted"))

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Take no new requests; with `drain`, finish the in-flight ones first; wait until the loop stopped."""
        self._accepting = False
        self._queue_stop(drain)
        if not await asyncio.get_running_loop().run_in_executor(None, self._loop_done.wait, timeout):
            logger.warning("engine loop still busy after %.0f s of draining; leaving it", timeout or 0)

    # --- the driver's part ----------------------------------------------------------------------
    def _queue_add(self, add: PendingAdd) -> None:
        raise NotImplementedError

    def _queue_abort(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def _queue_stop(self, drain: bool) -> None:
        raise NotImplementedError

    # --- admission --------------------------------------------------------------------------------
    def _admit(self, request_id: str, prompt: Prompt, params: SamplingParams,
               arrival: float) -> tuple[RequestStream, PendingAdd]:
        with self._admission_lock:
            self._check_admission(request_id)
            stream = RequestStream(request_id, asyncio.get_running_loop(), self._on_scheduled, self._release)
            add = PendingAdd(stream, prompt, params, arrival)
            self._queue_add(add)
        self._front_streams[request_id] = stream
        self.num_waiting += 1
        return stream, add

    def _check_admission(self, request_id: str) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}")
        if not self._accepting or self._loop_exited:
            raise EngineShutdownError("the server is shutting down and takes no new requests")
        if request_id in self._front_streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting to be scheduled "
                                 f"(the limit is {self.max_waiting}); try again later")

    def _on_scheduled(self) -> None:
        self.num_waiting -= 1

    def _release(self, stream: RequestStream) -> None:
        """The stream was closed (called once per stream, on the loop thread)."""
        self._front_streams.pop(stream.request_id, None)
        if not stream.finished:
            # The reader left early (disconnect, cancellation, error): free the request's blocks.
            stream.put(RequestAbortedError(f"request {stream.request_id!r} was abandoned"))
            self._queue_abort([stream.request_id])


class AsyncLLMEngine(AsyncEngineFront):
    """The engine on a thread of this process (see the module's docstring)."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], max_waiting: int | None = None,
                 observer: StepObserver | None = None) -> None:
        """Start the engine thread; returns once the engine is ready (load errors are raised here).

        `engine`: an LLMEngine, or better a function building one, which then runs on the engine thread.
        Why it matters: on CPU, once one thread has run torch's OpenMP regions (loading the model does),
        another thread's regions run 2-3x slower (measured with SmolLM2: a decode step 71 ms instead of
        36 ms), so the model must be loaded on the thread that steps it.
        `max_waiting`: refuse new requests (QueueFullError) while this many have not been scheduled yet.
        """
        super().__init__(max_waiting, observer)
        self._commands: queue.Queue[PendingAdd | _AbortRequests | _Stop] = queue.Queue()
        self._engine_streams: dict[str, RequestStream] = {}    # owned by the engine thread
        # The engine thread sets `engine` and the first `stats` (an EngineStats replaced, never mutated, after
        # every step) before `built` resolves.
        self.engine: LLMEngine
        built: concurrent.futures.Future[None] = concurrent.futures.Future()
        # Daemon: a process whose server failed to shut down cleanly must still be able to exit.
        thread = threading.Thread(target=self._build_and_run, args=(engine, built), name="deepserve-engine",
                                  daemon=True)
        thread.start()
        built.result()

    @property
    def tokenizer(self):
        # The tokenizer is read-only after loading, so the front may encode/decode on its own thread.
        return self.engine.tokenizer

    def _queue_add(self, add: PendingAdd) -> None:
        self._commands.put(add)

    def _queue_abort(self, request_ids: list[str]) -> None:
        self._commands.put(_AbortRequests(request_ids))

    def _queue_stop(self, drain: bool) -> None:
        self._commands.put(_Stop(drain))

    # --- engine thread ------------------------------------------------------------------------
    def _build_and_run(self, engine: LLMEngine | Callable[[], LLMEngine],
                       built: concurrent.futures.Future[None]) -> None:
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else engine()
            self.stats = self.engine.get_stats()
        except BaseException as error:  # noqa: BLE001 - handed to the constructor, which raises it
            self._dead = error
            self._loop_exited = True
            self._loop_done.set()
            built.set_exception(error)
            return
        built.set_result(None)
        self._run_loop()

    def _run_loop(self) -> None:
        stop: _Stop | None = None
        try:
            while True:
                stop = self._apply_commands(block=not self.engine.has_unfinished_requests() and stop is None,
                                            stop=stop)
                if stop is not None and not (stop.drain and self.engine.has_unfinished_requests()):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as error:  # any failure ends the loop: tell every reader why
            logger.exception("engine loop died")
            self._dead = error
            self._close(EngineDeadError(f"the engine loop died: {error!r}"))
            return
        if hasattr(self.engine, "shutdown"):
            # A multi-rank engine's other ranks, before `_close` lets the server's main thread go on to exit (an
            # interpreter exiting while this thread still tears the process groups down aborts).
            self.engine.shutdown()
        self._close(EngineShutdownError("the server shut down before this request finished"))

    def _close(self, error: BaseException) -> None:
        with self._admission_lock:
            self._loop_exited = True
        self._fail_all(error)
        self._reject_pending_adds()
        self._loop_done.set()

    def _apply_commands(self, block: bool, stop: _Stop | None) -> _Stop | None:
        """Apply queued commands; wait for one first when `block` (the engine has nothing to do)."""
        applied = False
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                if applied:
                    # Adds and aborts change the counts and free blocks even when no step follows.
                    self.stats = self.engine.get_stats()
                return stop
            block, applied = False, True
            if isinstance(command, PendingAdd):
                self._add(command, refuse=stop is not None)
            elif isinstance(command, _AbortRequests):
                self._abort(command.request_ids)
            elif isinstance(command, _Stop):
                stop = command
                if not command.drain:
                    self.engine.abort_request(list(self._engine_streams))
                    self._fail_all(EngineShutdownError("the server shut down without draining"))

    def _add(self, command: PendingAdd, refuse: bool) -> None:
        stream = command.stream
        if not command.accepted.set_running_or_notify_cancel():
            return      # the caller was cancelled before its request got here: never add it
        if refuse:
            command.accepted.set_exception(EngineShutdownError("the server is shutting down"))
            return
        try:
            self.engine.add_request(stream.request_id, command.prompt, command.params, command.arrival_time)
        except Exception as error:  # noqa: BLE001 - ValueError for bad input; anything else goes back too
            command.accepted.set_exception(error)
            return
        self._engine_streams[stream.request_id] = stream
        command.accepted.set_result(None)

    def _abort(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)
        for request_id in request_ids:
            stream = self._engine_streams.pop(request_id, None)
            if stream is not None:
                stream.put_threadsafe(RequestAbortedError(f"request {request_id!r} was aborted"))
        self._notify_observer("on_abort", request_ids)

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        self.stats = self.engine.get_stats()
        self._notify_observer("on_step", outputs, self.stats, now)
        for output in outputs:
            stream = self._engine_streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._engine_streams[output.request_id]
            stream.put_threadsafe(output)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._engine_streams.values():
            stream.put_threadsafe(error)
        self._engine_streams.clear()

    def _reject_pending_adds(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, PendingAdd) and command.accepted.set_running_or_notify_cancel():
                command.accepted.set_exception(EngineShutdownError("the server is shutting down"))

