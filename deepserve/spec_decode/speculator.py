"""The engine's side of speculative decoding: drafts before a step is scheduled, bookkeeping after it ran.

Before `Scheduler.schedule`: every decoding sequence gets `seq.draft_token_ids` (possibly none) from the drafter,
capped so that emitting all of them plus one token stays within max_tokens and max_model_len, and cut to the
verification length the policy chose (all of them with verify_length="fixed").
After the step: the drafter's estimate learns from what was accepted; the sequence's and the engine's counters
grow. Rejected drafts never reach the sequence's token list, and the scheduler gives their KV slots back.

Sequences that draft: decoding ones (the prompt is done) whose next token needs nothing the verifier does not
apply: no repetition / presence / frequency penalty and no pending min_tokens ban (those depend on the tokens
before each row, drafts included). The others decode one token a step as without speculation.

Structured outputs: a sequence with a grammar drafts too. Its matcher fills one bitmask row per verification row
(tokens allowed after the drafts before it, accepted tentatively and rolled back), drafts past the first one the
grammar refuses are dropped, and the verifier masks each row before choosing; the matcher then advances over the
tokens actually emitted.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.config import SpeculativeConfig
from deepserve.sequence import Sequence
from deepserve.spec_decode.drafts import Drafts, ModelDrafter
from deepserve.spec_decode.dspark import DSparkDrafter
from deepserve.spec_decode.length_policy import StepCostModel, choose_verify_lengths
from deepserve.spec_decode.mtp import MTPDrafter
from deepserve.spec_decode.ngram import NgramDrafter


@dataclass
class SpecDecodeStats:
    """Engine-wide counters (Prometheus `deepserve:spec_decode_*`)."""
    num_drafts: int = 0             # sequence-steps that verified at least one draft
    num_draft_tokens: int = 0       # drafts verified
    num_accepted_tokens: int = 0    # drafts accepted
    num_steps: int = 0              # engine steps with speculation on and some sequence decoding
    num_verified_tokens: int = 0    # query rows of decoding sequences (1 + drafts each): / num_steps = rows a step


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, cost_model: StepCostModel | None = None) -> None:
        if config.num_speculative_tokens < 1:
            raise ValueError("speculative_config: num_speculative_tokens must be at least 1, got "
                             f"{config.num_speculative_tokens}")
        if config.verify_length == "confidence" and cost_model is None:
            raise ValueError("verify_length='confidence' needs a step cost model")
        self.config = config
        self.max_model_len = max_model_len
        self.cost_model = cost_model
        if config.method == "mtp":
            self.drafter = MTPDrafter()
        elif config.method == "dspark":
            self.drafter = DSparkDrafter()
        else:
            self.drafter = NgramDrafter(config.num_speculative_tokens, config.prompt_lookup_min,
                                        config.prompt_lookup_max)
        self.stats = SpecDecodeStats()
        self._proposed: dict[int, Drafts] = {}      # seq_id -> what was proposed for the step being scheduled

    # --- before scheduling --------------------------------------------------------------------
    def propose(self, running: list[Sequence]) -> None:
        """Set `draft_token_ids` on every running sequence (empty for those that do not draft this step)."""
        self._proposed.clear()
        decoding, proposals = [], []
        for seq in running:
            seq.draft_token_ids, seq.draft_probs = [], None
            if seq.num_tokens - seq.num_computed_tokens != 1 or seq.num_inflight:
                continue                        # prefilling (or a token still in flight): no drafts
            decoding.append(seq)
            limit = self._draft_limit(seq)
            proposals.append(self.drafter.propose(seq, limit) if limit > 0 else Drafts())
        if self.config.verify_length == "confidence" and decoding:
            lengths = choose_verify_lengths([d.confidences for d in proposals], self.cost_model.cost)
            proposals = [d.truncated(n) for d, n in zip(proposals, lengths)]
        for seq, drafts in zip(decoding, proposals):
            seq.draft_bitmask = seq.draft_probs = None
            if drafts.token_ids and seq.grammar is not None:
                drafts = self._constrain(seq, drafts)
            if drafts.token_ids:
                seq.draft_token_ids = list(drafts.token_ids)
                seq.draft_probs = drafts.probs
                self._proposed[seq.seq_id] = drafts
        self.drafter.step()

    @staticmethod
    def _constrain(seq: Sequence, drafts: Drafts) -> Drafts:
        """Keep the drafts the sequence's grammar allows; `seq.draft_bitmask` gets a mask row per verification row."""
        mask, allowed = seq.grammar.fill_bitmask_for_drafts(drafts.token_ids)
        seq.draft_bitmask = mask[:allowed + 1] if allowed else None
        return drafts.truncated(allowed)

    def _draft_limit(self, seq: Sequence) -> int:
        p = seq.params
        if (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                or seq.num_output_tokens < p.min_tokens):
            return 0
        limit = min(self.config.num_speculative_tokens, self.max_model_len - seq.num_tokens)
        if p.max_tokens is not None:
            limit = min(limit, p.max_tokens - seq.num_output_tokens - 1)
        return limit

    # --- after the step -----------------------------------------------------------------------
    def record_step(self, num_rows: int, step_ms: float | None) -> None:
        """A step ran in which decoding sequences had `num_rows` query rows in all (1 + drafts each)."""
        if num_rows == 0:
            return
        self.stats.num_steps += 1
        self.stats.num_verified_tokens += num_rows
        if step_ms is not None and self.cost_model is not None:
            self.cost_model.observe(num_rows, step_ms)

    def record(self, seq: Sequence, num_verified: int, num_accepted: int) -> None:
        drafts = self._proposed.get(seq.seq_id)
        if drafts is None or num_verified == 0:
            return
        self.drafter.observe(drafts, num_verified, num_accepted)
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += num_verified
        self.stats.num_accepted_tokens += num_accepted

    def take_model_drafts(self, drafts: dict) -> None:
        """Drafts a model-based drafter produced in the step just collected (the MTP layer's, the DSpark blocks')."""
        if drafts and isinstance(self.drafter, ModelDrafter):
            self.drafter.latest.update(drafts)

    def forget(self, seq: Sequence) -> None:
        self.drafter.forget(seq)
        self._proposed.pop(seq.seq_id, None)
