"""LLMEngine: the step loop. add_request -> step() ... -> RequestOutputs; abort_request frees at once.

One step:  Scheduler.schedule -> ModelRunner.launch -> (ModelRunner.collect -> OutputProcessor -> Scheduler.commit)
of this step, or with overlapped scheduling of the step before it.
The engine is synchronous and single-threaded; servers drive it from one loop (engine/async_engine.py).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from deepserve import envs
from deepserve.config import EngineArgs, EngineConfig
from deepserve.engine.block_manager import BlockManager, WindowPool
from deepserve.engine.grammar_queue import GrammarQueue
from deepserve.engine.kv_store_connector import attach_kv_store
from deepserve.engine.output_processor import OutputProcessor, RequestState
from deepserve.engine.scheduler import Scheduler
from deepserve.layers.rank_group import ParallelContext
from deepserve.outputs import RequestOutput
from deepserve.parallel.step_vote import StepKind, StepVote
from deepserve.sampling_params import SamplingParams
from deepserve.sequence import Sequence, SequenceStatus
from deepserve.spec_decode.gate import SpeculationGate
from deepserve.spec_decode.length_policy import StepCostModel
from deepserve.spec_decode.speculator import Speculator
from deepserve.structured.compiler import GrammarCompiler
from deepserve.worker.launched_step import LaunchedStep
from deepserve.worker.model_runner import ModelRunner
from deepserve.worker.scheduler_output import ScheduledSequence, SchedulerOutput

logger = logging.getLogger(__name__)

_SEED_STRIDE = 0x9E3779B97F4A7C15   # spreads the n children of one seeded request over the seed space
_U64 = (1 << 64) - 1

Prompt = str | list[int] | dict[str, Any]


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    # Speculative decoding (0 without it): see spec_decode/speculator.py's SpecDecodeStats.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_steps: int = 0
    spec_decode_num_verified_tokens: int = 0
    kv_store: dict | None = None        # KVStoreConnector.metrics() when a kv_store is configured
    # Expert parallelism: sum over steps of the busiest EP rank's routed tokens / of the mean rank's (1.0 = even),
    # over the balancer's window (worker/expert_balancer.py); None without expert parallelism.
    moe_lb: float | None = None
    num_eplb_rebalances: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig, parallel: ParallelContext | None = None) -> None:
        """`parallel`: this rank's groups when the engine is one rank of several (engine/multi_rank_engine.py runs
        them); every rank of a data-parallel replica then calls `step` in lockstep with the others."""
        envs.warn_unknown_variables()      # a mistyped DEEPSERVE_* name would otherwise be silently ignored
        self.config = config
        self.tokenizer = None
        if not config.model.skip_tokenizer_init:
            from deepserve.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_pretrained(config.model.model)
        eos = set(self.tokenizer.eos_token_ids) if self.tokenizer else _config_eos_ids(config.model.hf_config)
        self.runner = ModelRunner(config, eos, parallel=parallel)
        parallel = self.runner.parallel
        # Data-parallel replicas: every step is prompt-only or decode-only, agreed by votes on the DP group.
        self.step_vote = (StepVote(lambda v: int(parallel.dp.all_reduce_min(torch.tensor([v])).item()))
                          if parallel.dp.size > 1 else None)
        cache = config.cache
        window = WindowPool(cache.num_window_blocks, cache.window_reach) if cache.num_window_blocks else None
        self.block_manager = BlockManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching, window)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.scheduler.prompt_window_keep = getattr(self.runner.model, "prompt_window_keep", None)
        self.kv_store = attach_kv_store(config, self.runner, self.block_manager, self.scheduler)
        self.outputs = OutputProcessor(self.tokenizer, eos, config.scheduler.max_model_len)
        self.requests: dict[str, RequestState] = {}
        self._seed_rng = random.Random(config.model.seed)
        self._next_seq_id = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.speculator = self._build_speculator(config)
        # Drafts are proposed from a sequence's known tokens, so with speculation a step's tokens must be on the host
        # before the next step is scheduled: the loop runs without overlap while it speculates. With the gate
        # (verify_length "confidence"), it speculates only while that is faster than overlapped plain decoding.
        spec = config.speculative
        # Prompt lookup only: the model drafters (MTP, DSpark) draft inside the forward, which then cannot overlap.
        self.spec_gate = (SpeculationGate() if spec is not None and spec.verify_length == "confidence" and spec.gate
                          and spec.method == "ngram" else None)
        self.overlap_capable = config.scheduler.async_scheduling
        self._inflight: tuple[SchedulerOutput, LaunchedStep] | None = None   # launched, not yet collected
        # Structured outputs: grammars compile in a thread pool (nothing of xgrammar loads until one does);
        # their sequences wait in `grammars` until compiled, outside the scheduler.
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
        self.grammars = GrammarQueue(self.vocab_size)

    def _build_speculator(self, config: EngineConfig) -> Speculator | None:
        spec = config.speculative
        if spec is None:
            return None
        cost_model = None
        if spec.verify_length == "confidence":
            curve = spec.cost_curve or self.runner.measure_step_costs(
                _cost_curve_sizes(config, spec.num_speculative_tokens), min(1024, config.scheduler.max_model_len))
            logger.info("speculative decoding: step cost curve (rows, ms) %s", curve)
            # With CUDA graphs a step costs the graph of its row count rounded up to a captured size.
            cost_model = StepCostModel(curve, padded=self.runner.cuda_graphs is not None)
        return Speculator(spec, config.scheduler.max_model_len, cost_model)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    @property
    def vocab_size(self) -> int:
        return self.config.model.vocab_size

    # --- requests -----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """Text or token ids -> (text, token ids), validated against the model. Raises ValueError."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine was started with skip_tokenizer_init: give prompt_token_ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, prompt
        else:
            raise ValueError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        ids = self._validate_token_ids(ids)
        return text, ids

    def _validate_token_ids(self, ids: Iterable[Any]) -> list[int]:
        ids = list(ids)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be integers")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        limit = self.config.scheduler.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens but max_model_len is {limit}, which leaves "
                             "no room to generate")
        return ids

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, final_output_only: bool = False) -> None:
        """Queue a request. Raises ValueError on bad input, leaving the engine unchanged.

        `final_output_only`: `step()` reports the request once, when it finishes (offline use: building a
        RequestOutput for every request at every step costs as much as the scheduling)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.prepare_request(prompt, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = [Sequence(self._new_seq_id(), request_id, i, ids, params, self._seed_for(params, i), arrival)
                for i in range(params.n)]
        state = self.outputs.new_request(request_id, text, ids, params, seqs, arrival)
        state.final_output_only = final_output_only
        self.requests[request_id] = state
        self._enqueue(seqs, params)

    def prepare_request(self, prompt: Prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Every check of a request, changing nothing: (text, token ids), or ValueError saying what is wrong."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize_prompt(prompt)
        why_not = getattr(self.runner.model, "prompt_logprobs_unavailable", None)
        if params.prompt_logprobs is not None and why_not:
            raise ValueError(f"prompt_logprobs: not available with this model's settings ({why_not})")
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids: {bad_stop[0]} is outside the vocabulary [0, {self.vocab_size})")
        if params.structured_outputs is not None:
            if self.runner.parallel.tp.size > 1:
                # Grammars compile in threads and join the scheduler when done: tensor-parallel ranks would admit
                # them at different steps.
                raise ValueError("structured outputs are not supported with tensor_parallel_size > 1 yet")
            self.grammar_compiler.check(params.structured_outputs)     # a bad schema: ValueError, nothing queued
        return text, ids

    def _enqueue(self, seqs: list[Sequence], params: SamplingParams) -> None:
        """To the scheduler, or first to the grammar queue until the request's grammar compiled."""
        spec = params.structured_outputs
        if spec is None:
            for seq in seqs:
                self.scheduler.add(seq)
            return
        self.grammars.add(seqs, spec, self.grammar_compiler.submit(spec))

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests now and give their KV blocks back. Unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for request_id in ids:
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            for seq in state.seqs:
                if self.grammars.remove(seq):
                    seq.status = SequenceStatus.FINISHED_ABORTED       # never scheduled: holds no blocks
                else:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                self._forget(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return outputs of the requests that progressed."""
        return [self.outputs.make_output(state) for state in self.step_states()]

    def step_states(self) -> list[RequestState]:
        """`step` without building RequestOutputs: the states of the requests to report. The engine process
        (engine/engine_process.py) sends only what changed in them, which costs less than a whole RequestOutput.
        A finished request's state is returned once and then forgotten by the engine.

        Overlapped (async_scheduling): the step launched here runs on the device while the host collects and
        processes the step before it, so step n+1 is scheduled and prepared while step n computes. Tokens are the
        same as in the plain loop: a sequence's next input is read on the device from the step that sampled it,
        and a step computed for a sequence that turned out to have finished is dropped."""
        touched: dict[str, RequestState] = self._admit_compiled()
        speculating = self.speculating
        if speculating:
            if self._inflight is not None:      # back from overlapped plain decoding: drafts need known tokens
                self._finish(self._inflight, touched)
                self._inflight = None
            self.speculator.propose(self.scheduler.running)
        elif self.speculator is not None:
            for seq in self.scheduler.running:
                seq.draft_token_ids = []
        generated_before = self.generation_tokens
        sched_out = self._schedule()
        sched_out.speculative = speculating
        for seq in sched_out.ignored:
            touched[seq.request_id] = self.requests[seq.request_id]
        previous = self._inflight
        if previous is not None and any(_needs_known_outputs(s.seq) for s in sched_out.scheduled):
            # Penalties count output tokens on the host: wait for the in-flight ones first.
            self._finish(previous, touched)
            previous = None
            sched_out.scheduled = [s for s in sched_out.scheduled if not s.seq.is_finished]
        launched = None
        started = time.perf_counter()
        if not sched_out.is_empty:
            handle = self.runner.launch(sched_out, previous[1] if previous is not None else None)
            for s in sched_out.scheduled:
                if s.samples:
                    s.seq.num_inflight += 1
            launched = (sched_out, handle)
        elif self.runner.needs_placeholder_steps:
            self.runner.placeholder_forward()       # nothing here this step: still enter the MoE collectives
        if self.runner.expert_balancer is not None:
            self.runner.expert_balancer.end_step()  # this step's expert counts; a rebalance when one is due
        overlapped = self.overlap_capable and not speculating
        self._inflight = launched if overlapped else None
        if launched is None and previous is None and self.kv_store is not None:
            # Nothing to compute: only KV-store fetches (if any) are running; let their threads have the CPU.
            self.kv_store.wait_for_fetch(timeout=0.01)
        if previous is not None:
            self._finish(previous, touched)
        if launched is not None and not overlapped:
            self._finish(launched, touched)
            if speculating:
                self._record_spec_step(sched_out, (time.perf_counter() - started) * 1e3)
        if self.spec_gate is not None:
            decode_only = bool(sched_out.scheduled) and all(_is_decode(s) for s in sched_out.scheduled)
            self.spec_gate.step_done(self.generation_tokens - generated_before, decode_only)
        return self._reported(touched)

    @property
    def speculating(self) -> bool:
        """Whether the next step proposes drafts."""
        return self.speculator is not None and (self.spec_gate is None or self.spec_gate.speculating)

    @property
    def async_scheduling(self) -> bool:
        """Whether the loop overlaps steps now (never while it speculates)."""
        return self.overlap_capable and not self.speculating

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's step; for a data-parallel replica, of the kind the replicas voted for (step_vote.py)."""
        if self.step_vote is None:
            return self.scheduler.schedule()
        attempt: list[SchedulerOutput] = []

        def schedule_prefill() -> SchedulerOutput | None:
            attempt.append(self.scheduler.schedule(StepKind.PROMPT))
            return attempt[0] if not attempt[0].is_empty else None
        decision = self.step_vote.decide(self.scheduler.wants_prompt_step(), schedule_prefill)
        if decision.kind is StepKind.PROMPT:
            return decision.prompts or (attempt[0] if attempt else SchedulerOutput())
        out = self.scheduler.schedule(StepKind.DECODE)
        if attempt:             # a prompt attempt that scheduled nothing may still have finished some as IGNORED
            out.ignored = attempt[0].ignored + out.ignored
        return out

    def _record_spec_step(self, sched_out: SchedulerOutput, step_ms: float) -> None:
        """Decode rows of the step (1 + drafts each) and its time, for the speculator's counters and cost model.
        A step that also computed prompt chunks is not a verification step's cost: it only counts."""
        rows = sum(s.num_new_tokens for s in sched_out.scheduled if _is_decode(s))
        pure = rows == sched_out.num_batched_tokens
        self.speculator.record_step(rows, step_ms if pure else None)

    def _admit_compiled(self) -> dict[str, RequestState]:
        """Structured sequences whose grammar compiled join the scheduler; failed ones finish (FINISHED_SO_FAILED).
        Returns the requests of the failed ones, to report."""
        if not len(self.grammars):
            return {}
        if not self.scheduler.has_unfinished() and self._inflight is None:
            self.grammars.wait(timeout=0.05)        # nothing to step: let the compile threads have the CPU
        ready, failed = self.grammars.take_ready()
        for seq in ready:
            self.scheduler.add(seq)
        touched = {}
        for seq in failed:
            seq.status = SequenceStatus.FINISHED_SO_FAILED
            state = self.requests.get(seq.request_id)
            if state is not None:
                state.metrics.finished_time = time.monotonic()
                touched[seq.request_id] = state
        return touched

    def _finish(self, launched: tuple[SchedulerOutput, LaunchedStep], touched: dict[str, RequestState]) -> None:
        """Collect a launched step's tokens and apply them: stops, detokenization, prefix-cache naming."""
        sched_out, handle = launched
        runner_out = self.runner.collect(handle)
        if self.speculator is not None:
            self.speculator.take_model_drafts(runner_out.mtp_drafts)
        now = time.monotonic()
        # Bound methods and counters in locals: this loop runs for every scheduled sequence of every step.
        requests, process, commit = self.requests, self.outputs.process, self.scheduler.commit
        prompt_tokens = generation_tokens = 0
        for s in sched_out.scheduled:
            seq = s.seq
            state = requests.get(seq.request_id)
            if state is None or seq.is_finished:
                continue      # aborted, or finished by an earlier step while this one ran: its result is dropped
            if not state.final_output_only:
                touched[state.request_id] = state
            if s.start < seq.num_prompt_tokens:
                prompt_tokens += min(s.start + s.num_new_tokens, seq.num_prompt_tokens) - s.start
            before = len(seq.token_ids)
            finished_status = process(state, s, runner_out, now)
            generation_tokens += len(seq.token_ids) - before
            if sched_out.speculative and _is_decode(s):
                self._apply_verification(state, s, runner_out.num_accepted_drafts.get(seq.seq_id, 0))
            commit(seq)
            if finished_status is not None:
                self.scheduler.finish(seq, finished_status)
                # A final-output-only request is reported once, when it finishes: only then is it touched.
                touched[state.request_id] = state
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens

    def _apply_verification(self, state: RequestState, s, num_accepted: int) -> None:
        """After a decode step of a speculating engine: rejected drafts give back their KV, counters grow."""
        num_drafts = len(s.draft_token_ids)
        self.scheduler.rewind(s.seq, num_drafts - num_accepted)
        self.speculator.record(s.seq, num_drafts, num_accepted)
        m = state.metrics
        m.spec_num_steps += 1
        m.spec_num_draft_tokens += num_drafts
        m.spec_num_accepted_tokens += num_accepted

    def _forget(self, seq: Sequence) -> None:
        if self.speculator is not None:
            self.speculator.forget(seq)

    def _reported(self, touched: dict[str, RequestState]) -> list[RequestState]:
        results = []
        for request_id, state in touched.items():
            finished = state.finished
            if finished or not state.final_output_only:
                results.append(state)
            if finished:
                del self.requests[request_id]
                for seq in state.seqs:
                    self._forget(seq)
        return results

    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, bm.usage, bm.num_blocks,
                           bm.num_free_blocks, bm.prefix_queries, bm.prefix_hits, self.scheduler.num_preemptions,
                           self.prompt_tokens, self.generation_tokens,
                           kv_store=self.kv_store.metrics() if self.kv_store is not None else None,
                           **self._spec_stats(), **self._eplb_stats())

    def _eplb_stats(self) -> dict[str, Any]:
        balancer = self.runner.expert_balancer
        if balancer is None:
            return {}
        return {"moe_lb": balancer.moe_lb, "num_eplb_rebalances": balancer.num_rebalances}

    def _spec_stats(self) -> dict[str, int]:
        if self.speculator is None:
            return {}
        st = self.speculator.stats
        return {"spec_decode_num_drafts": st.num_drafts, "spec_decode_num_draft_tokens": st.num_draft_tokens,
                "spec_decode_num_accepted_tokens": st.num_accepted_tokens, "spec_decode_num_steps": st.num_steps,
                "spec_decode_num_verified_tokens": st.num_verified_tokens}

    # --- helpers ------------------------------------------------------------------------------
    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def _seed_for(self, params: SamplingParams, index: int) -> int:
        if params.seed is None:
            return self._seed_rng.getrandbits(64)
        return (params.seed + index * _SEED_STRIDE) & _U64


def _config_eos_ids(hf_config: dict[str, Any]) -> set[int]:
    eos = hf_config.get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


def _is_decode(s: ScheduledSequence) -> bool:
    """A decode step of a sequence past its prompt: one known token (plus drafts) that samples."""
    return s.samples and s.num_new_tokens - len(s.draft_token_ids) == 1 and s.start >= s.seq.num_prompt_tokens


def _cost_curve_sizes(config: EngineConfig, k: int) -> list[int]:
    """Row counts the start-up cost curve measures: powers of two up to every sequence verifying k drafts (capped by
    the step budget and at 512 rows, which bounds start-up time on the CPU), and that cap itself."""
    cap = min(config.scheduler.max_num_seqs * (k + 1), config.scheduler.max_num_batched_tokens, 512)
    sizes, g = [], 1
    while g < cap:
        sizes.append(g)
        g *= 2
    return sizes + [cap]


def _needs_known_outputs(seq: Sequence) -> bool:
    """Sampling this sequence reads its output tokens on the host (penalties count them; a grammar's bitmask
    depends on every token the matcher has seen), so none may be in flight."""
    p = seq.params
    return seq.num_inflight > 0 and (seq.grammar is not None or p.repetition_penalty != 1.0
                                     or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)
