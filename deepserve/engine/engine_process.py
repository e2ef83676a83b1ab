"""The engine process of a server: an LLMEngine stepped in a child process, reached through two pipes.

    server process (engine/engine_client.py)                 engine process (this module, one loop)
    AddCommand / AbortCommand / StopCommand ── commands pipe ──► engine.add_request / abort_request, in order
                                                                 engine.step_states() while there is work
    streams <── fan-out by handle ◄── updates pipe ── ONE EngineUpdate per loop iteration: the adds it took
                                                      (or refused), each reported request's delta, stats

Why a process: in one process the HTTP server's Python (FastAPI, SSE, JSON, the tokenizer) and the engine's
scheduling share one GIL, and the engine's steps wait for it. Why "spawn": forking a process that already runs
torch (its OpenMP pool, CUDA) and threads is unsafe.

A delta carries only what changed since the request's last report: the new token ids, logprobs and text, so a
step's message grows with the batch, not with the length of the outputs. Text: the engine detokenizes only
requests with stop strings (OutputProcessor.detokenize_all off), because a stop string must end generation here,
at the token that completed it, and cut the text there; every other request's text is made by the client, off
this loop. Requests are named by the client's handles (ints), so an output of an aborted request can never be
mistaken for one of a newer request reusing its id.

The loop ends on StopCommand (after draining, if asked), when the server process goes away (the commands pipe
reaches EOF: no orphaned engine), or when a step raises: then it sends EngineFailed and exits.
"""

from __future__ import annotations

import logging
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from deepserve.config import EngineArgs, EngineConfig
from deepserve.engine.async_engine import EngineShutdownError
from deepserve.engine.engine import EngineStats, LLMEngine, Prompt
from deepserve.engine.output_processor import RequestState
from deepserve.engine.startup_heap import freeze_startup_heap
from deepserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# One reported request in an EngineUpdate, as a plain tuple (pickled and unpickled per request per step: no
# class to look up or construct):
#   (handle, finished, num_cached_tokens, metrics, error, prompt_logprobs, seqs)
#   metrics = (first_scheduled_time, first_token_time, last_token_time, finished_time, num_preemptions,
#              spec_num_draft_tokens, spec_num_accepted_tokens, spec_num_steps)
#   prompt_logprobs: the whole list when it changed since the last report, else None
#   seqs = [(index, new_token_ids, text_keep, text_add, new_logprobs, cumulative_logprob, finish_reason,
#            stop_reason)]
#   text_keep: -1 when the engine makes no text for the request (the client detokenizes); otherwise the text is
#   text[:text_keep] + text_add (a stop string can cut text already sent)
#   new_logprobs: None without logprobs
RequestDelta = tuple


@dataclass
class AddCommand:
    handle: int
    request_id: str
    prompt: Prompt
    params: SamplingParams
    arrival_time: float


@dataclass
class AbortCommand:
    handles: list[int]


@dataclass
class StopCommand:
    drain: bool


@dataclass
class EngineInfo:
    """What the server reads of the engine: `AsyncLLMEngine.engine` has the same attributes (multi-rank and kv
    store ones are None: those servers keep the engine in their process)."""

    config: EngineConfig
    vocab_size: int
    kv_store: Any = None
    grammar_compiler: Any = None


@dataclass
class EngineReady:
    info: EngineInfo
    stats: EngineStats


@dataclass
class EngineUpdate:
    # (handle, None, prompt text, prompt token ids) for an add the engine took; (handle, error, None, None) else.
    accepted: list[tuple[int, BaseException | None, str | None, list[int] | None]] = field(default_factory=list)
    outputs: list[RequestDelta] = field(default_factory=list)
    stats: EngineStats | None = None
    now: float = 0.0            # time.monotonic() after the step (the same clock in every process of the host)


@dataclass
class EngineStopped:
    reason: str                 # the error message for requests still open (none after a drain)


@dataclass
class EngineFailed:
    error: BaseException        # the exception itself when it pickles, else a RuntimeError describing it
    traceback: str


def picklable(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure to pickle
        return RuntimeError(f"{type(error).__name__}: {error}")


def run_engine_process(args: EngineArgs, commands: Connection, updates: Connection, log_level: int) -> None:
    """The child's entry point: build the engine, report EngineReady (or EngineFailed), serve until stopped."""
    # Ctrl-C reaches the whole process group: the server process decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s [engine]: %(message)s")
    try:
        engine = LLMEngine.from_engine_args(args)
        engine.outputs.detokenize_all = False
        info = EngineInfo(engine.config, engine.vocab_size)
        updates.send(EngineReady(info, engine.get_stats()))
    except BaseException as error:  # noqa: BLE001 - reported to the server, which raises it
        updates.send(EngineFailed(picklable(error), traceback.format_exc()))
        return
    _warm_up_grammars(engine)
    freeze_startup_heap()               # the process lives as long as the engine: frozen for good
    EngineLoop(engine, commands, updates).run()


def _warm_up_grammars(engine: LLMEngine) -> None:
    """Import xgrammar and build its vocabulary view in the background (as the in-process server does)."""
    import importlib.util
    compiler = engine.grammar_compiler
    if compiler.tokenizer is None or importlib.util.find_spec("xgrammar") is None:
        return

    def prepare() -> None:
        try:
            compiler.prepare()
        except Exception:   # structured requests will report the failure themselves
            logger.warning("structured outputs: preparing the grammar compiler failed", exc_info=True)
    threading.Thread(target=prepare, name="deepserve-grammar-warmup", daemon=True).start()


class _Reported:
    """What a request's client already has: per sequence, tokens, text length and logprobs sent."""

    __slots__ = ("handle", "tokens", "chars", "logprobs", "prompt_logprobs")

    def __init__(self, handle: int, n: int) -> None:
        self.handle = handle
        self.tokens = [0] * n
        self.chars = [0] * n
        self.logprobs = [0] * n
        self.prompt_logprobs = 0


class EngineLoop:
    def __init__(self, engine: LLMEngine, commands: Connection, updates: Connection) -> None:
        self.engine = engine
        self.commands = commands
        self.updates = updates
        self._reported: dict[str, _Reported] = {}     # engine request id -> what its client has
        self._request_of: dict[int, str] = {}         # handle -> engine request id
        self._accepted: list = []
        self._changed = False       # a command was applied since the last update (the stats moved)

    def run(self) -> None:
        engine = self.engine
        stop: StopCommand | None = None
        try:
            while True:
                stop = self._apply_commands(block=not engine.has_unfinished_requests() and stop is None, stop=stop)
                if stop is not None and not (stop.drain and engine.has_unfinished_requests()):
                    break
                states = engine.step_states() if engine.has_unfinished_requests() else []
                self._send_update(states)
        except (EOFError, OSError):
            # The server process is gone (its end of a pipe closed): nobody to serve, nothing to report.
            logger.warning("the server process went away; the engine process exits")
            return
        except BaseException as error:  # noqa: BLE001 - any failure ends the loop: tell the server why
            logger.exception("engine loop died")
            self._send_quietly(EngineFailed(picklable(error), traceback.format_exc()))
            return
        self._send_update([])
        reason = ("the server shut down without draining" if not stop.drain
                  else "the server shut down before this request finished")
        self._send_quietly(EngineStopped(reason))

    def _send_quietly(self, message: Any) -> None:
        try:
            self.updates.send(message)
        except (OSError, EOFError):
            pass

    # --- commands ---------------------------------------------------------------------------------
    def _apply_commands(self, block: bool, stop: StopCommand | None) -> StopCommand | None:
        """Apply every queued command in order; wait for one first when `block` (nothing to step)."""
        if block:
            self.commands.poll(None)
        while self.commands.poll():
            command = self.commands.recv()
            self._changed = True
            if isinstance(command, AddCommand):
                self._add(command, refuse=stop is not None)
            elif isinstance(command, AbortCommand):
                self._abort(command.handles)
            elif isinstance(command, StopCommand):
                stop = command
                if not command.drain:
                    self.engine.abort_request(list(self._reported))
                    self._reported.clear()
                    self._request_of.clear()
        return stop

    def _add(self, command: AddCommand, refuse: bool) -> None:
        if refuse:
            self._accepted.append((command.handle, EngineShutdownError("the server is shutting down"), None, None))
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, command.arrival_time)
        except Exception as error:  # noqa: BLE001 - ValueError for bad input; anything else goes back too
            self._accepted.append((command.handle, picklable(error), None, None))
            return
        state = self.engine.requests[command.request_id]
        self._reported[command.request_id] = _Reported(command.handle, len(state.seqs))
        self._request_of[command.handle] = command.request_id
        self._accepted.append((command.handle, None, state.prompt, state.prompt_token_ids))

    def _abort(self, handles: list[int]) -> None:
        ids = [self._request_of.pop(h) for h in handles if h in self._request_of]
        self.engine.abort_request(ids)
        for request_id in ids:
            del self._reported[request_id]

    # --- outputs ----------------------------------------------------------------------------------
    def _send_update(self, states: list[RequestState]) -> None:
        if not states and not self._changed:
            return
        outputs = [self._delta(state) for state in states if state.request_id in self._reported]
        update = EngineUpdate(self._accepted, outputs, self.engine.get_stats(), time.monotonic())
        self._accepted, self._changed = [], False
        self.updates.send(update)

    def _delta(self, state: RequestState) -> RequestDelta:
        sent = self._reported[state.request_id]
        seqs = []
        for seq in state.seqs:
            i = seq.index
            st = state.per_seq[seq.seq_id]
            start = seq.num_prompt_tokens + sent.tokens[i]
            new_tokens = seq.token_ids[start:]
            sent.tokens[i] += len(new_tokens)
            keep, add = -1, ""
            if st.detokenizer is not None:
                # The text only grows, except where a stop string cut it: keep what still holds, send the rest.
                keep = min(sent.chars[i], len(st.text))
                add = st.text[keep:]
                sent.chars[i] = len(st.text)
            new_logprobs = None
            if st.logprobs is not None:
                new_logprobs = st.logprobs[sent.logprobs[i]:]
                sent.logprobs[i] = len(st.logprobs)
            seqs.append((i, new_tokens, keep, add, new_logprobs, st.cumulative_logprob,
                         seq.status.finish_reason, seq.stop_reason))
        prompt_logprobs = None
        if state.prompt_logprobs is not None and len(state.prompt_logprobs) != sent.prompt_logprobs:
            prompt_logprobs = state.prompt_logprobs
            sent.prompt_logprobs = len(prompt_logprobs)
        m = state.metrics
        metrics = (m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time,
                   sum(s.num_preemptions for s in state.seqs), m.spec_num_draft_tokens, m.spec_num_accepted_tokens,
                   m.spec_num_steps)
        finished = state.finished
        if finished:
            del self._reported[state.request_id]
            del self._request_of[sent.handle]
        errors = [s.error for s in state.seqs if s.error]
        return (sent.handle, finished, min(s.num_cached_tokens for s in state.seqs), metrics,
                errors[0] if errors else None, prompt_logprobs, seqs)
