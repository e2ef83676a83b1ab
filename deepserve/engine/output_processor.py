"""Turns sampled tokens into request outputs: stop checks, incremental detokenization, logprobs.

Token-level stops (EOS, stop_token_ids, max_tokens, max_model_len) and text-level stops (stop strings,
matched on the detokenized text and cut from it) are decided here; the engine then tells the scheduler.

With `detokenize_all` off (the engine process of a server, engine/engine_process.py), only requests with stop
strings are detokenized here: their stop must end generation in the engine, at the token that completed it. The
others get no text (""): the server's front process detokenizes their tokens, off the engine's loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.outputs import CompletionOutput, Logprob, LogprobsEntry, RequestMetrics, RequestOutput
from deepserve.sampling_params import SamplingParams
from deepserve.sequence import Sequence, SequenceStatus
from deepserve.worker.launched_step import TokenLogprobs
from deepserve.worker.model_runner import ModelRunnerOutput
from deepserve.worker.scheduler_output import ScheduledSequence


@dataclass
class SequenceOutputState:
    seq: Sequence
    detokenizer: object | None
    text: str = ""
    logprobs: list[LogprobsEntry] | None = None
    cumulative_logprob: float = 0.0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    per_seq: dict[int, SequenceOutputState]
    metrics: RequestMetrics
    prompt_logprobs: list[LogprobsEntry | None] | None = None
    final_output_only: bool = False     # report the request only once it has finished

    @property
    def finished(self) -> bool:
        for seq in self.seqs:       # a loop, not all(<generator>): read for every request at every step
            if not seq.is_finished:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.detokenize_all = True      # False: only requests with stop strings (see the module's docstring)

    def new_request(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                    seqs: list[Sequence], arrival: float) -> RequestState:
        per_seq = {}
        for seq in seqs:
            detok = None
            if self.tokenizer is not None and (self.detokenize_all or params.stop):
                from deepserve.tokenizer import IncrementalDetokenizer
                detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
            per_seq[seq.seq_id] = SequenceOutputState(seq, detok, logprobs=[] if params.logprobs is not None else None)
        prompt_lp = [None] if params.prompt_logprobs is not None else None
        return RequestState(request_id, prompt, list(prompt_ids), params, seqs, per_seq,
                            RequestMetrics(arrival_time=arrival), prompt_lp)

    # --- one scheduled sequence's step result ---------------------------------------------------
    def process(self, state: RequestState, sched: ScheduledSequence, out: ModelRunnerOutput,
                now: float) -> SequenceStatus | None:
        """Apply one step's results to a sequence; return a finish status if it just finished."""
        seq, metrics = sched.seq, state.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = now
        chunk_lp = out.prompt_logprobs.get(seq.seq_id) if out.prompt_logprobs else None
        if chunk_lp and state.prompt_logprobs is not None and len(state.prompt_logprobs) < seq.num_prompt_tokens:
            state.prompt_logprobs.extend(self._logprobs_entry(e) for e in chunk_lp)
        if not out.spec_token_ids:
            # The common step: one sampled token (or none), without the lists of the speculative path.
            token = out.sampled_token_ids.get(seq.seq_id)
            if token is None:
                return None
            metrics.last_token_time = now
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            seq.resolve_inflight_token(token)
            entry = out.logprobs.get(seq.seq_id) if out.logprobs else None
            status = self._append_token(seq, state.per_seq[seq.seq_id], token, entry)
            if status is not None:
                metrics.finished_time = now
            return status
        tokens, entries = _new_tokens(seq.seq_id, out)
        if not tokens:
            return None
        seq_state = state.per_seq[seq.seq_id]
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        status = None
        for i, (token, entry) in enumerate(zip(tokens, entries)):
            # The first token was counted in flight when the step launched; accepted drafts come on top of it.
            if i == 0:
                seq.resolve_inflight_token(token)
            else:
                seq.append_token(token)
            status = self._append_token(seq, seq_state, token, entry)
            if status is not None:
                break       # tokens after a stop are dropped (accepted drafts past an EOS or a stop string)
        if status is not None:
            metrics.finished_time = now
        return status

    def _append_token(self, seq: Sequence, seq_state: "SequenceOutputState", token: int,
                      entry: TokenLogprobs | None) -> SequenceStatus | None:
        """Logprobs, stop checks and text of one token just added to `seq`; a finish status if it ends it."""
        if entry is not None and seq_state.logprobs is not None:
            seq_state.logprobs.append(self._logprobs_entry(entry))
            seq_state.cumulative_logprob += entry[1]
        status = self._grammar_stop(seq, token) if seq.grammar is not None else None
        if status is None:
            status = self._token_stop(seq, token)
        if seq_state.detokenizer is not None:
            seq_state.text += seq_state.detokenizer.step([token])
            if status is None:
                status = self._stop_string(seq, seq_state)
            else:
                seq_state.text += seq_state.detokenizer.flush()   # a trailing partial character, if any
        return status

    def _grammar_stop(self, seq: Sequence, token: int) -> SequenceStatus | None:
        """Advance the sequence's grammar (structured outputs) over its new token: a token it rejects ends the
        sequence as FINISHED_SO_FAILED (never "stop"), a grammar that reached its end ends it as stopped."""
        matcher = seq.grammar
        if matcher is None:
            return None
        if not matcher.accept(token):
            seq.stop_reason = token     # the token the grammar refused (kept in the output, as a stop token is)
            return SequenceStatus.FINISHED_SO_FAILED
        return SequenceStatus.FINISHED_STOPPED if matcher.is_terminated else None

    def _token_stop(self, seq: Sequence, token: int) -> SequenceStatus | None:
        """EOS, stop_token_ids, max_tokens and max_model_len, for `token`, just appended to `seq`."""
        p, length = seq.params, len(seq.token_ids)
        out_len = length - seq.num_prompt_tokens
        if out_len >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if p.stop_token_ids and token in p.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        if p.max_tokens is not None and out_len >= p.max_tokens:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        if self.max_model_len is not None and length >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH_CAPPED
        return None

    def _stop_string(self, seq: Sequence, st: SequenceOutputState) -> SequenceStatus | None:
        p = seq.params
        if not p.stop or seq.num_output_tokens < p.min_tokens:
            return None
        # Only the tail can hold a match that did not exist before this token.
        window = max(len(s) for s in p.stop) + 16
        tail_start = max(len(st.text) - window, 0)
        best = None
        for stop in p.stop:
            i = st.text.find(stop, tail_start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        st.text = st.text[:i + len(stop)] if p.include_stop_str_in_output else st.text[:i]
        seq.stop_reason = stop
        return SequenceStatus.FINISHED_STOPPED

    def _logprobs_entry(self, entry: TokenLogprobs) -> LogprobsEntry:
        token, lp, top_ids, top_vals = entry
        result: LogprobsEntry = {}
        for rank, (tid, val) in enumerate(zip(top_ids, top_vals), start=1):
            result[tid] = Logprob(val, rank, self._decode_one(tid))
        if token not in result:
            rank = None
            result[token] = Logprob(lp, rank, self._decode_one(token))
        return result

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # --- assembling RequestOutput ---------------------------------------------------------------
    def make_output(self, state: RequestState) -> RequestOutput:
        outputs = []
        for seq in state.seqs:
            st = state.per_seq[seq.seq_id]
            outputs.append(CompletionOutput(
                index=seq.index, text=st.text, token_ids=list(seq.output_token_ids),
                cumulative_logprob=st.cumulative_logprob if st.logprobs is not None else None,
                logprobs=st.logprobs, finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason))
        state.metrics.num_preemptions = sum(s.num_preemptions for s in state.seqs)
        errors = [s.error for s in state.seqs if s.error]
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=outputs, finished=state.finished, prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=min(s.num_cached_tokens for s in state.seqs), metrics=state.metrics,
            error=errors[0] if errors else None)


def _new_tokens(seq_id: int, out: ModelRunnerOutput) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The tokens a step emitted for a sequence (one, or accepted drafts + one) and their logprobs entries."""
    tokens = out.spec_token_ids.get(seq_id)
    if tokens is not None:
        entries = out.spec_logprobs.get(seq_id)
        return tokens, entries if entries is not None else [None] * len(tokens)
    token = out.sampled_token_ids.get(seq_id)
    if token is None:
        return [], []
    return [token], [out.logprobs.get(seq_id)]
