"""Engine logprobs (per position: token id -> Logprob(logprob, rank, decoded_token)) -> OpenAI's two formats.

/v1/completions uses the legacy format (parallel lists: tokens, token_logprobs, top_logprobs, text_offset);
/v1/chat/completions a list of {token, logprob, bytes, top_logprobs: [...]}.
JSON has no -inf: a token the sampler ruled out (e.g. by top-k) reports -9999.0, as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from deepserve.outputs import Logprob, LogprobsEntry
from deepserve.serving.openai.protocol import (
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)

_FLOOR = -9999.0


def finite(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


def token_text(token_id: int, entry: Logprob | None, tokenizer) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else str(token_id)


def ranked(entry: LogprobsEntry, top_n: int) -> list[tuple[int, Logprob]]:
    """The top `top_n` alternatives of one position, most likely first."""
    with_rank = [(tid, lp) for tid, lp in entry.items() if lp.rank is not None]
    with_rank.sort(key=lambda item: item[1].rank)
    return with_rank[:top_n]


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[LogprobsEntry | None], top_n: int,
                        tokenizer, text_offset: int = 0) -> CompletionLogprobs:
    """Legacy format for `token_ids[i]` with `entries[i]`; an entry None (a prompt's first token) has no logprob."""
    result = CompletionLogprobs()
    offset = text_offset
    for token_id, entry in zip(token_ids, entries):
        own = entry.get(token_id) if entry is not None else None
        text = token_text(token_id, own, tokenizer)
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
        result.token_logprobs.append(finite(own.logprob) if own is not None else None)
        if entry is None:
            result.top_logprobs.append(None)
        else:
            top = {token_text(tid, lp, tokenizer): finite(lp.logprob) for tid, lp in ranked(entry, top_n)}
            result.top_logprobs.append(top)
    return result


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[LogprobsEntry], top_n: int,
                  tokenizer) -> list[TokenLogprob]:
    content = []
    for token_id, entry in zip(token_ids, entries):
        own = entry.get(token_id)
        text = token_text(token_id, own, tokenizer)
        top = [_top(tid, lp, tokenizer) for tid, lp in ranked(entry, top_n)]
        content.append(TokenLogprob(token=text, logprob=finite(own.logprob) if own is not None else _FLOOR,
                                    bytes=list(text.encode()), top_logprobs=top))
    return content


def _top(token_id: int, lp: Logprob, tokenizer) -> TopLogprob:
    text = token_text(token_id, lp, tokenizer)
    return TopLogprob(token=text, logprob=finite(lp.logprob), bytes=list(text.encode()))
