"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Every sequence carries `num_computed_tokens`; a step gives each scheduled sequence some new tokens
to compute so that it catches up with `num_tokens`. A decode is 1 new token, a prefill is many, a
chunk of a long prompt is a part of it: one mechanism, so decodes and prefill chunks mix freely.

Invariants:
- running sequences are served first, in admission order; the budget left goes to waiting ones (FCFS), except
  that a waiting sequence whose KV-store fetch is still running is passed over, keeping its place, and the ones
  behind it may be admitted meanwhile (it holds no blocks while it waits);
- while any sequence decodes, prompt chunks get at most `max_prefill_tokens_while_decoding` tokens of a step
  (when set: a CPU default), so that no decode waits behind a long prefill;
- when blocks run out, the most recently admitted running sequence is preempted (its KV dropped, it goes
  back to the front of `waiting`); no new sequence is admitted in a step that preempted, and admissions
  keep a watermark of free blocks, so a resumed sequence is not preempted again straight away;
- a sequence that could never fit (more blocks than the whole cache) is finished as IGNORED, not retried;
- after a step, `num_computed_tokens` already counts the tokens scheduled in it (the runner computes
  them before anything else reads the sequence);
- with overlapped scheduling, a sequence's token sampled by the step still on the device counts in
  `num_tokens` (`num_inflight`), so the next step is scheduled before that token's id reaches the host;
- with data-parallel replicas (`schedule(kind)`, kind chosen by the votes of parallel/step_vote.py) a step is
  prompt-only (prompt chunks of running sequences, then admissions) or decode-only (running sequences' decode
  rows), never both: DeepInfer's NORMAL policy, so every replica's step has the same kind.
"""

from __future__ import annotations

from collections import deque

from deepserve.config import SchedulerConfig
from deepserve.engine.block_manager import BlockManager
from deepserve.parallel.step_vote import KV_USAGE_LIMIT, StepKind
from deepserve.sequence import Sequence, SequenceStatus
from deepserve.worker.scheduler_output import ScheduledSequence, SchedulerOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._watermark_blocks = int(config.watermark * block_manager.num_blocks)
        # The KV store's side (engine/kv_store_connector.py): load_prefix(seq) before a prefix lookup (False: a
        # background fetch for it runs, it waits), forget(seq) and save_finished(seq) before a finished sequence's
        # blocks are freed. None: no store.
        self.kv_store = None
        # YOCO (models/yoco.py): a prompt step writes every layer's window states only for the last this many tokens
        # of the sequence (the model's `prompt_window_keep`); None: for every token.
        self.prompt_window_keep: int | None = None

    # --- queue management ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Finish `seq` wherever it is and give its blocks back."""
        assert status.is_finished
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = status
        if self.kv_store is not None:
            self.kv_store.forget(seq)           # an aborted waiting sequence's fetch is dropped
            self.kv_store.save_finished(seq)
        self.block_manager.free(seq)
        self.block_manager.forget(seq)

    # --- one step -----------------------------------------------------------------------------
    def schedule(self, kind: StepKind | None = None) -> SchedulerOutput:
        """One step: mixed (kind None: decodes first, then prompt chunks under the budget), or only prompt work or
        only decodes (data-parallel replicas)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget, prefill = self._schedule_running(out, budget, self._prefill_budget(budget), kind)
        if not out.preempted and kind is not StepKind.DECODE:
            self._schedule_waiting(out, min(budget, prefill))
        out.blocks_to_copy = self.block_manager.take_pending_copies()
        out.window_blocks_to_copy = self.block_manager.take_pending_window_copies()
        return out

    def wants_prompt_step(self) -> bool:
        """A replica's side of the prompt-step vote: its cache has room and it has prompt work (a waiting sequence, or
        a running one whose prompt is partly computed), or it has nothing to decode (an idle replica does not hold
        the others back; the second vote still requires that somebody schedules)."""
        decoding = any(s.num_tokens - s.num_computed_tokens <= 1 for s in self.running)
        prompt_work = bool(self.waiting) or any(s.num_tokens - s.num_computed_tokens > 1 for s in self.running)
        return not decoding or (self.block_manager.usage <= KV_USAGE_LIMIT and prompt_work)

    def _prefill_budget(self, budget: int) -> int:
        """Tokens this step may give to prefills (work of more than one token). Every decode waits for its whole step,
        so while one runs, the config's cap (if any) keeps prompt chunks from stalling it."""
        cap = self.config.max_prefill_tokens_while_decoding
        if cap is None or not any(s.num_tokens - s.num_computed_tokens <= 1 for s in self.running):
            return budget
        return min(cap, budget)

    def _schedule_running(self, out: SchedulerOutput, budget: int, prefill: int,
                          kind: StepKind | None = None) -> tuple[int, int]:
        """Returns the (step, prefill) budgets left."""
        # Attribute reads hoisted out of the loop: it runs for every running sequence at every step.
        running, scheduled, fits_in_place = self.running, out.scheduled, self.block_manager.fits_in_place
        max_model_len = self.config.max_model_len
        prompt_kind = kind is StepKind.PROMPT
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            known, inflight = len(seq.token_ids), seq.num_inflight
            if inflight and _finishes_by_length(seq, known, max_model_len):
                i += 1          # its in-flight token is its last: nothing more to compute
                continue
            left = known + inflight - seq.num_computed_tokens       # num_tokens - num_computed_tokens
            is_prefill = left > 1
            if kind is not None and is_prefill != prompt_kind:
                i += 1          # not this kind of step's work
                continue
            n = min(left, budget, prefill) if is_prefill else min(left, budget)
            # Drafts to verify ride along a decode row, as far as the budget goes (slots for them are allocated like
            # any token's; `rewind` gives back the rejected ones' after the step).
            drafts = seq.draft_token_ids[:max(budget - 1, 0)] if n == 1 and seq.draft_token_ids else []
            n += len(drafts)
            # Most decode steps fit in the sequence's last block: no allocation, no preemption check.
            fits = n > 0 and fits_in_place(seq, n)
            if fits or (n > 0 and self._make_room(seq, n, out)):
                scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, n, drafts))
                if not fits:
                    self.block_manager.allocate_slots(seq, n)
                seq.num_computed_tokens += n
                budget -= n
                if is_prefill:
                    prefill -= n
            i += 1
        return budget, prefill

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Preempt from the back of `running` until `seq` gets its blocks; False if `seq` itself went."""
        bm = self.block_manager
        while not bm.can_grow(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in order until one does not fit. A sequence whose KV-store fetch is still
        running is passed over (it keeps its place); the ones behind it may be admitted meanwhile."""
        bm = self.block_manager
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[i]
            if bm.blocks_for_tokens(seq.num_tokens + 1) > bm.num_blocks:
                self._ignore(i, out)
                continue
            # Prompt logprobs need logits at every prompt position, so such requests compute all of it.
            hits = [] if seq.params.prompt_logprobs is not None else self._cached_prefix(seq)
            if hits is None:
                i += 1
                continue
            computed = len(hits) * bm.block_size
            n = seq.num_tokens - computed
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            reserve = self._watermark_blocks if self.running else 0
            if not bm.can_admit(seq, n, hits, reserve):
                break
            del self.waiting[i]
            bm.allocate_slots(seq, n, hits)
            bm.record_prefix_lookup(seq.num_tokens, computed)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = computed
            if self.prompt_window_keep is not None:
                seq.window_complete_from = max(0, seq.num_tokens - self.prompt_window_keep)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, computed, n))
            seq.num_computed_tokens = computed + n
            budget -= n

    def _cached_prefix(self, seq: Sequence) -> list[int] | None:
        """Device prefix-cache hits, once the KV store (if any) has loaded the blocks it holds beyond them;
        None while the store's fetch for `seq` runs in the background (it is not admitted yet)."""
        if self.kv_store is not None and not self.kv_store.load_prefix(seq):
            return None
        return self.block_manager.find_cached_prefix(seq)

    def _ignore(self, index: int, out: SchedulerOutput) -> None:
        """Finish `waiting[index]`, which could never fit, as IGNORED."""
        seq = self.waiting[index]
        del self.waiting[index]
        seq.status = SequenceStatus.FINISHED_IGNORED
        seq.error = (f"sequence of {seq.num_tokens} tokens needs more KV blocks than the whole cache "
                     f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size} tokens)")
        self.block_manager.forget(seq)
        out.ignored.append(seq)

    # --- after the forward pass ---------------------------------------------------------------
    def rewind(self, seq: Sequence, num_rejected: int) -> None:
        """`num_rejected` drafts at the end of the step's positions were rejected: their KV is not the sequence's.
        Computed tokens go back to the accepted ones and blocks beyond them are freed (rejected drafts never keep
        blocks; the slots left inside the last block are overwritten by the next step)."""
        if num_rejected and seq.status is SequenceStatus.RUNNING:
            seq.num_computed_tokens -= num_rejected
            self.block_manager.trim(seq)

    def commit(self, seq: Sequence) -> None:
        """A step computed `seq`'s KV and its sampled token is known: name its full blocks for the prefix cache, then
        give back the window blocks it has left behind (after naming them: they stay hits for later sequences)."""
        if seq.status is _RUNNING:
            bm = self.block_manager
            bm.cache_full_blocks(seq)
            if bm.window is not None:       # (no window pool: nothing to release, skip the call)
                bm.release_window(seq)


# Reading a member off an Enum class goes through its metaclass (~90 ns on CPython 3.11): `commit`, which runs for
# every sequence at every step, compares against this module-level name.
_RUNNING = SequenceStatus.RUNNING


def _finishes_by_length(seq: Sequence, known: int, max_model_len: int) -> bool:
    """The sequence's tokens in flight (`known` of them on the host) reach max_tokens or max_model_len."""
    max_tokens = seq.params.max_tokens
    return ((max_tokens is not None and known - seq.num_prompt_tokens + seq.num_inflight >= max_tokens)
            or known + seq.num_inflight >= max_model_len)
