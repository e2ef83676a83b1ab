"""POST /tokenize and POST /detokenize (vLLM's extension endpoints): text or chat messages <-> token ids."""

from __future__ import annotations

from deepserve.serving.openai.context import ServerContext
from deepserve.serving.openai.errors import bad_request
from deepserve.serving.openai.prompts import render_chat
from deepserve.serving.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)


class TokenizationEndpoints:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        ctx = self.ctx
        ctx.check_model(body.model)
        tokenizer = ctx.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            text = render_chat(body.messages, tokenizer, body.add_generation_prompt)
            add_special = bool(body.add_special_tokens)          # the template already holds BOS
        else:
            text = body.prompt
            add_special = body.add_special_tokens is not False
        ids = tokenizer.encode(text, add_special_tokens=add_special)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        ctx = self.ctx
        ctx.check_model(body.model)
        vocab_size = ctx.engine.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens))
