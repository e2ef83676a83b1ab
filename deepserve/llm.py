"""`LLM`: the offline API (vLLM-compatible): generate() and chat() over one engine."""

from __future__ import annotations

import weakref
from typing import Any, Sequence

from tqdm.auto import tqdm

from deepserve.config import EngineArgs
from deepserve.engine.engine import Prompt
from deepserve.engine.multi_rank_engine import create_engine, serve_if_worker_rank
from deepserve.engine.startup_heap import freeze_startup_heap, release_startup_heap
from deepserve.outputs import RequestOutput
from deepserve.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """Several ranks (tensor_parallel_size / data_parallel_size > 1): they are spawned on this host; under
        torchrun every process runs this, and only rank 0 returns (the others serve it, then exit)."""
        self.engine_args = EngineArgs.from_kwargs(model=model, **engine_args)
        serve_if_worker_rank(self.engine_args)
        self.engine = create_engine(self.engine_args)
        self._next_request_id = 0
        if freeze_startup_heap():
            weakref.finalize(self, release_startup_heap)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks that repeat the same prompts must not measure cache hits)."""
        self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine's other ranks, if it has any (also done at exit)."""
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        request_ids = self._add_all(prompt_list, params)
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (the engine was started with skip_tokenizer_init)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 **(chat_template_kwargs or {}))
            # The template already holds any BOS it wants; do not add another.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    # --- internals ----------------------------------------------------------------------------
    def _add_all(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[str]:
        """Add every request or none: a bad prompt raises after the ones before it are withdrawn."""
        added: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                request_id = str(self._next_request_id)
                try:
                    self.engine.add_request(request_id, prompt, p, final_output_only=True)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
                self._next_request_id += 1
                added.append(request_id)
        except BaseException:
            self.engine.abort_request(added)
            raise
        return added

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self.engine.abort_request(request_ids)
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]


def _as_prompt_list(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        raise ValueError("a bare list of ints is ambiguous: pass {'prompt_token_ids': [...]}")
    return prompts


def _as_params_list(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
    return params
