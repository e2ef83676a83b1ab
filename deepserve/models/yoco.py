"""YOCO bounded suffix replay (deepinfer.md §8): in prefill, the consumer half of DeepSeek-V4.1 computes only the last
KEEP tokens of each sequence.

Why it is sound: the consumer half's global memory (compressed KV and index keys, shared by all consumer layers)
is built from the *producer* half's output (the shared hidden of the first consumer layer) for every token, so
consumer layers still attend sparsely to the whole context. Only the consumer layers' sliding window loses keys
before the suffix, and decoding afterwards needs only the last W + BT of them, which lie inside it.

Per sequence of a step, with data_len = its whole length (prompt and generated tokens), rect_lo = data_len - KEEP:
    kept rows     [q_start + clip, q_end), clip = clamp(rect_lo - q_start, 0, q_len - 1)
                  (a chunk wholly before the suffix keeps its last row, a placeholder)
    consumer SWA  a row at p sees keys in [max(p - W + 1, rect_lo), p]
    modes         mask: every row is computed, the consumer window narrowed; compact: consumer layers compute
                  the kept rows only (after the first consumer layer's KV sources have written compressed KV
                  and index keys for all rows). Both give the same numbers on kept rows.
It is a bounded change of semantics, not an identity with `off`: results can differ after preemption or with
another chunking (data_len, hence the suffix, moves).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve import envs

MODES = ("off", "mask", "compact")


@dataclass(frozen=True)
class YocoTruncation:
    mode: str = "off"
    keep: int = 0

    @property
    def active(self) -> bool:
        return self.mode != "off"

    @property
    def compact(self) -> bool:
        return self.mode == "compact"

    def kept_range(self, q_start: int, q_len: int, data_len: int) -> tuple[int, int]:
        """The positions [lo, q_end) a chunk of q_len tokens from q_start keeps (all of them when off)."""
        if not self.active:
            return q_start, q_start + q_len
        clip = min(max(data_len - self.keep - q_start, 0), q_len - 1)
        return q_start + clip, q_start + q_len

    def window_floor(self, data_len: int) -> int:
        """The first position a consumer layer's sliding window may see in this sequence (rect_lo), 0 when off."""
        return max(data_len - self.keep, 0) if self.active else 0


def minimum_keep(window: int, tokens_per_decode_step: int = 1) -> int:
    """KEEP >= W + BT, BT = tokens a decode step writes (1 + draft tokens): 128 + 6 = 134 with 5 drafts."""
    return window + max(1, tokens_per_decode_step)


def yoco_from_env(*, window: int, has_consumer_half: bool, consumer_engram: bool, draft_targets_split: bool,
                  num_draft_tokens: int = 0) -> YocoTruncation:
    """The truncation DEEPSERVE_YOCO_PREFILL_TRUNCATION_MODE / _KEEP_TOKENS ask for, validated against the model:
    a consumer half must exist, KEEP >= window + 1 + num_draft_tokens, and compact forbids Engram in consumer
    layers and draft target layers on both sides of the split (§8 restrictions). Each violation: a ValueError
    naming the variable."""
    mode, keep = envs.DEEPSERVE_YOCO_PREFILL_TRUNCATION_MODE, envs.DEEPSERVE_YOCO_PREFILL_KEEP_TOKENS
    if mode not in MODES:
        raise ValueError(f"YOCO: DEEPSERVE_YOCO_PREFILL_TRUNCATION_MODE={mode!r}: one of {', '.join(MODES)}")
    if mode == "off":
        return YocoTruncation()
    name = "YOCO: DEEPSERVE_YOCO_PREFILL_TRUNCATION_MODE"
    if not has_consumer_half:
        raise ValueError(f"{name}={mode}: this model has no YOCO consumer half (no layer with compress ratio 1)")
    need = minimum_keep(window, 1 + num_draft_tokens)
    if keep < need:
        raise ValueError(f"YOCO: DEEPSERVE_YOCO_PREFILL_KEEP_TOKENS={keep}: must be >= sliding window + tokens per "
                         f"decode step ({window} + {need - window} = {need}) when the mode is {mode}")
    if mode == "compact" and consumer_engram:
        raise ValueError(f"{name}=compact: Engram in a consumer-half layer is not supported (use mask)")
    if mode == "compact" and draft_targets_split:
        raise ValueError(f"{name}=compact: the DSpark target layers must all lie on one side of the YOCO split")
    return YocoTruncation(mode, keep)
