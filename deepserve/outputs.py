"""What the engine hands back: vLLM-compatible RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

# One generated position's log-probabilities: token id -> Logprob (the sampled token plus the top-k).
LogprobsEntry = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None          # 1 = most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[LogprobsEntry] | None
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "structured_output_failed" | None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Speculative decoding (all n outputs together): drafts verified, drafts accepted, decode steps taken.
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_steps: int = 0

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per decode step (1 without speculation); None before the first decode step."""
        if not self.spec_num_steps:
            return None
        return (self.spec_num_steps + self.spec_num_accepted_tokens) / self.spec_num_steps


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[LogprobsEntry | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Set when the engine had to give up on the request (e.g. it can never fit in the KV cache).
    error: str | None = field(default=None)
