"""EngineProcessClient: the AsyncLLMEngine interface over an engine in its own process (engine/engine_process.py).

    event loop thread                                   reader thread                 engine process
    add_request ─ AddCommand(handle) ─────────────────────────────────────────────►  commands pipe
    abort / closed stream ─ AbortCommand ─────────────────────────────────────────►
    _deliver(update): rebuild each RequestOutput,  ◄─ call_soon_threadsafe ◄─ recv ◄─ updates pipe
    detokenize, observer.on_step, stream.put             (resolves `accepted`)        (one message per step)

The server's Python (HTTP, JSON, SSE, detokenization) then no longer takes GIL time from the engine's loop, and a
step costs the event loop one wake-up instead of one per request.

Invariants, besides AsyncEngineFront's:
- commands go through one pipe, sent under `_send_lock`, so the engine applies them in the order they were sent;
- a request is named by a handle (an int, new for every add) in both directions: the outputs of an aborted
  request are dropped here, never delivered to a newer request that reuses its id;
- an abort (explicit, or a stream closed early) forgets the request here at once (`on_abort` too) and tells the
  engine, which frees its blocks at its next iteration; outputs still on their way for it are dropped;
- the engine process's end (EngineStopped, EngineFailed, or the pipe's EOF when it died) ends every open stream
  once, with EngineShutdownError or EngineDeadError; adds not answered yet get the same error;
- `stats` is the engine's EngineStats after its last iteration; `shutdown` returns with the child process gone.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import threading
from dataclasses import dataclass, field

from deepserve.config import EngineArgs
from deepserve.engine.async_engine import (
    AsyncEngineFront,
    EngineDeadError,
    EngineShutdownError,
    PendingAdd,
    StepObserver,
)
from deepserve.engine.engine_process import (
    AbortCommand,
    AddCommand,
    EngineFailed,
    EngineInfo,
    EngineReady,
    EngineStopped,
    EngineUpdate,
    RequestDelta,
    StopCommand,
    run_engine_process,
)
from deepserve.outputs import CompletionOutput, LogprobsEntry, RequestMetrics, RequestOutput
from deepserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Seconds `shutdown` waits for the child to exit after its loop stopped, before it is terminated.
_EXIT_TIMEOUT_S = 30.0


@dataclass
class _SeqText:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    detokenizer: object | None = None      # set when the engine leaves this request's text to the client
    logprobs: list[LogprobsEntry] | None = None


class _Request:
    """A request's outputs so far, rebuilt from the engine's deltas (event loop thread only)."""

    def __init__(self, handle: int, request_id: str, params: SamplingParams, arrival_time: float) -> None:
        self.handle = handle
        self.request_id = request_id
        self.params = params
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs = None
        self.seqs = [_SeqText(logprobs=[] if params.logprobs is not None else None) for _ in range(params.n)]

    def accepted(self, prompt: str | None, prompt_token_ids: list[int], tokenizer) -> None:
        self.prompt, self.prompt_token_ids = prompt, prompt_token_ids
        if tokenizer is not None and not self.params.stop:
            from deepserve.tokenizer import IncrementalDetokenizer
            for seq in self.seqs:
                seq.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, self.params.skip_special_tokens)

    def apply(self, delta: RequestDelta) -> RequestOutput:
        _, finished, num_cached, metrics, error, prompt_logprobs, seq_deltas = delta
        m = self.metrics
        (m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time, m.num_preemptions,
         m.spec_num_draft_tokens, m.spec_num_accepted_tokens, m.spec_num_steps) = metrics
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        outputs = []
        for index, new_tokens, keep, add, new_logprobs, cumulative, finish_reason, stop_reason in seq_deltas:
            seq = self.seqs[index]
            seq.token_ids.extend(new_tokens)
            if keep >= 0:
                seq.text = seq.text[:keep] + add if keep < len(seq.text) else seq.text + add
            elif seq.detokenizer is not None:
                # Token by token, as the engine's OutputProcessor does, so that the text is the same.
                for token in new_tokens:
                    seq.text += seq.detokenizer.step((token,))
                if finish_reason is not None:
                    seq.text += seq.detokenizer.flush()
            if new_logprobs:
                seq.logprobs.extend(new_logprobs)
            outputs.append(CompletionOutput(
                index=index, text=seq.text, token_ids=list(seq.token_ids),
                cumulative_logprob=cumulative if seq.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=finish_reason, stop_reason=stop_reason))
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=finished, prompt_logprobs=self.prompt_logprobs,
                             num_cached_tokens=num_cached, metrics=m, error=error)


class EngineProcessClient(AsyncEngineFront):
    def __init__(self, args: EngineArgs, max_waiting: int | None = None, observer: StepObserver | None = None,
                 start_timeout_s: float | None = None) -> None:
        """Spawn the engine process and return once its engine is built (load errors are raised here, as the
        engine raised them when they pickle). `max_waiting`, `observer`: as for AsyncLLMEngine."""
        super().__init__(max_waiting, observer)
        ctx = multiprocessing.get_context("spawn")
        child_commands, self._commands = ctx.Pipe(duplex=False)
        self._updates, child_updates = ctx.Pipe(duplex=False)
        # Daemon: the child is terminated if this process exits without shutting it down (and a parent killed
        # outright closes the pipes, which ends the child's loop).
        self.process = ctx.Process(target=run_engine_process, name="deepserve-engine", daemon=True,
                                   args=(args, child_commands, child_updates, logging.getLogger().level))
        self.process.start()
        # Only the child holds these ends now: when it dies, reading the updates pipe reaches EOF.
        child_commands.close()
        child_updates.close()
        self._send_lock = threading.Lock()
        self._handles = itertools.count()
        self._handle_of: dict[str, int] = {}               # open request id -> its handle (loop thread)
        self._requests: dict[int, _Request] = {}           # handle -> outputs so far (loop thread)
        self._pending: dict[int, PendingAdd] = {}           # handle -> add not answered yet (under the lock)
        self._loop: asyncio.AbstractEventLoop | None = None  # where streams live: the latest admission's loop
        self._tokenizer = None
        try:
            if not args.skip_tokenizer_init:
                # The front's own copy (prompts, chat templates, detokenization), loaded while the child loads.
                from deepserve.tokenizer import Tokenizer
                self._tokenizer = Tokenizer.from_pretrained(args.resolve_model_path())
        except BaseException:
            self._kill()
            raise
        ready = self._wait_ready(start_timeout_s)
        self.engine: EngineInfo = ready.info
        self.stats = ready.stats
        self._reader = threading.Thread(target=self._read_updates, name="deepserve-engine-reader", daemon=True)
        self._reader.start()

    @property
    def tokenizer(self):
        return self._tokenizer

    def _wait_ready(self, timeout_s: float | None) -> EngineReady:
        try:
            if not self._updates.poll(timeout_s):
                raise TimeoutError(f"the engine process was not ready in {timeout_s} s")
            message = self._updates.recv()
        except (EOFError, OSError):
            self.process.join(5)
            message = EngineFailed(EngineDeadError(f"the engine process exited with code {self.process.exitcode} "
                                                   "before its engine was built"), "")
        except BaseException:
            self._kill()
            raise
        if isinstance(message, EngineFailed):
            self._kill()
            self._loop_exited = True
            self._loop_done.set()
            raise message.error
        return message

    # --- commands (event loop thread) --------------------------------------------------------------
    def _send(self, command) -> None:
        with self._send_lock:
            self._commands.send(command)

    def _queue_add(self, add: PendingAdd) -> None:
        # Called under the admission lock: the reader answers every add queued before the engine's end.
        handle = next(self._handles)
        request_id = add.stream.request_id
        self._loop = add.stream.loop
        self._pending[handle] = add
        try:
            self._send(AddCommand(handle, request_id, add.prompt, add.params, add.arrival_time))
        except (OSError, ValueError):       # the engine process is gone; the reader reports why
            del self._pending[handle]
            raise EngineDeadError("the engine process is not running") from None
        self._handle_of[request_id] = handle
        self._requests[handle] = _Request(handle, request_id, add.params, add.arrival_time)

    def _queue_abort(self, request_ids: list[str]) -> None:
        known = [r for r in request_ids if r in self._handle_of]
        if not known:
            return      # finished, refused, or aborted already
        handles = [self._handle_of.pop(r) for r in known]
        for handle in handles:
            self._requests.pop(handle, None)
        self._notify_observer("on_abort", known)
        try:
            self._send(AbortCommand(handles))
        except (OSError, ValueError):
            pass        # the engine process is gone, and with it every request

    def _queue_stop(self, drain: bool) -> None:
        try:
            self._send(StopCommand(drain))
        except (OSError, ValueError):
            pass

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """As AsyncLLMEngine.shutdown; then wait for the engine process to exit (terminated if it does not)."""
        await super().shutdown(drain, timeout)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.process.join, _EXIT_TIMEOUT_S if self._loop_done.is_set() else 0)
        self._kill()

    def _kill(self) -> None:
        if self.process.is_alive():
            logger.warning("terminating the engine process (pid %d)", self.process.pid)
            self.process.terminate()
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(10)

    # --- reader thread -------------------------------------------------------------------------------
    def _read_updates(self) -> None:
        while True:
            try:
                message = self._updates.recv()
            except (EOFError, OSError):
                self.process.join(5)
                self._end(EngineDeadError(f"the engine process died (exit code {self.process.exitcode})"), dead=True)
                return
            if isinstance(message, EngineUpdate):
                self._on_update(message)
            elif isinstance(message, EngineStopped):
                self._end(EngineShutdownError(message.reason), dead=False)
                return
            elif isinstance(message, EngineFailed):
                logger.error("the engine loop died:\n%s", message.traceback)
                self._end(EngineDeadError(f"the engine loop died: {message.error!r}"), dead=True, cause=message.error)
                return

    def _on_update(self, update: EngineUpdate) -> None:
        self.stats = update.stats
        for handle, error, _, _ in update.accepted:
            with self._admission_lock:
                add = self._pending.pop(handle, None)
            if add is None or not add.accepted.set_running_or_notify_cancel():
                continue    # the caller was cancelled meanwhile: closing its stream aborted the request
            if error is None:
                add.accepted.set_result(None)
            else:
                add.accepted.set_exception(error)
        self._call_on_loop(self._deliver, update)

    def _end(self, error: BaseException, dead: bool, cause: BaseException | None = None) -> None:
        """The engine loop is over: answer the pending adds, fail the open streams, wake `shutdown`."""
        with self._admission_lock:
            self._loop_exited = True
            if dead:
                self._dead = cause or error
            pending, self._pending = self._pending, {}
        for add in pending.values():
            if add.accepted.set_running_or_notify_cancel():
                add.accepted.set_exception(error)
        self._call_on_loop(self._fail_all, error)
        self._loop_done.set()

    def _call_on_loop(self, callback, *args) -> None:
        loop = self._loop
        if loop is None:
            return      # no request was ever made: no stream to tell
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass        # the event loop is closed: nobody is left to read a stream

    # --- event loop thread ---------------------------------------------------------------------------
    def _deliver(self, update: EngineUpdate) -> None:
        for handle, error, prompt, prompt_token_ids in update.accepted:
            request = self._requests.get(handle)
            if request is not None:
                if error is None:
                    request.accepted(prompt, prompt_token_ids, self._tokenizer)
                else:
                    self._forget(request)
        outputs = []
        for delta in update.outputs:
            request = self._requests.get(delta[0])
            if request is None:
                continue        # aborted here after the engine computed this step
            output = request.apply(delta)
            outputs.append(output)
            stream = self._front_streams.get(request.request_id)
            if output.finished:
                self._forget(request)
            if stream is not None:
                stream.put(output)
        if outputs:
            self._notify_observer("on_step", outputs, update.stats, update.now)

    def _forget(self, request: _Request) -> None:
        del self._requests[request.handle]
        if self._handle_of.get(request.request_id) == request.handle:
            del self._handle_of[request.request_id]

    def _fail_all(self, error: BaseException) -> None:
        for request in list(self._requests.values()):
            self._forget(request)
        for stream in list(self._front_streams.values()):
            stream.put(error)

