"""Helpers for comparing the engine with HF transformers on tiny random models (imported by tests).

`save_tiny` writes a sharpened random HF model; `engine_logits` runs prompts through the paged path;
`check_mixed_batch` runs several greedy requests under chunked prefill, preemption and prefix-cache hits
and compares every token and its logprob with HF's own greedy decoding.
"""

from __future__ import annotations

import torch

from deepserve import LLM, SamplingParams
from deepserve.worker.scheduler_output import ScheduledSequence, SchedulerOutput
from deepserve.sequence import Sequence
from deepserve.worker.batch_builder import build_forward_batch

VOCAB = 512


def save_tiny(path, config, model_cls, seed: int = 0, sharpen: float = 3.0, bias_std: float = 0.0) -> str:
    """Random HF model saved with save_pretrained. Weights (matrices and 3-D expert stacks) are scaled by
    `sharpen` so logits are far from uniform and greedy decoding is not decided by near-ties; DeepSeek-V3's
    zero-initialised e_score_correction_bias gets N(0, bias_std) so that path is exercised."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(sharpen)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias") and bias_std:
                buf.normal_(0.0, bias_std)
    model.save_pretrained(str(path))
    return str(path)


# A tiny DeepSeek-V2/V3: MLA over a 32-wide latent (4 heads), a dense first layer, then DeepSeekMoE (8 experts, top 2,
# one shared expert).
TINY_DEEPSEEK = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                     max_position_embeddings=256, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32,
                     qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


def save_tiny_deepseek(path, version: int, **overrides) -> str:
    """`save_tiny` of a TINY_DEEPSEEK DeepSeek-V`version` (2 or 3), with `overrides` (routing, vocab_size, ...)."""
    import transformers
    config_cls, model_cls = {2: (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
                             3: (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)}[version]
    return save_tiny(path, config_cls(**{**TINY_DEEPSEEK, **overrides}), model_cls, bias_std=0.1)


def load_hf(path):
    import transformers

    # The eager expert loop is HF's plain reference (its CPU default, grouped_mm, is ~10x slower here).
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             experts_implementation="eager").eval()


def engine_logits(llm: LLM, token_ids: list[int], chunk: int | None = None, first_row: int = 0) -> torch.Tensor:
    """Logits at every position from `first_row` on, computed through the paged engine path (optionally chunked;
    each chunk asks for its rows at positions >= first_row)."""
    runner = llm.engine.runner
    bm = llm.engine.block_manager
    seq = Sequence(10**9, "probe", 0, token_ids, SamplingParams(), seed=0)
    chunk = chunk or len(token_ids)
    pieces = []
    for start in range(0, len(token_ids), chunk):
        n = min(chunk, len(token_ids) - start)
        bm.allocate_slots(seq, n)
        out = SchedulerOutput(scheduled=[ScheduledSequence(seq, start, n)])
        seq.num_computed_tokens += n
        wanted = [i for i in range(n) if start + i >= first_row]
        batch = build_forward_batch(out, runner.block_size, runner.device, [wanted])
        batch.attn_metadata = runner.attn_backend.build_metadata(batch)
        with torch.inference_mode():
            pieces.append(runner.model.compute_logits(runner.model(batch)))
    bm.free(seq)
    return torch.cat(pieces)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def hf_greedy(model, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation and the raw logits of each step ([steps, V])."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits).float()


def assert_close_relative(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4) -> None:
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rtol * scale, f"max abs error {err:.3e} vs logit scale {scale:.3e}"


def random_prompt(length: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_alone(path: str, hf, prompt_len: int = 37, **engine_kwargs) -> LLM:
    """Prompt logits (whole and in chunks of 5 over the paged prefix) and 32 greedy tokens vs HF."""
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8, **engine_kwargs)
    ids = random_prompt(prompt_len, seed=1)
    ref = hf_logits(hf, ids)
    assert_close_relative(engine_logits(llm, ids), ref)
    assert_close_relative(engine_logits(llm, ids, chunk=5), ref)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32)[0]
    return llm


def mixed_prompts(vocab: int = VOCAB) -> list[list[int]]:
    """Six prompts of mixed lengths; four share a 20-token prefix (prefix-cache hits)."""
    shared = random_prompt(20, seed=7, vocab=vocab)
    lengths = [6, 41, 13, 58, 27, 9]
    return [(shared if i % 3 else []) + random_prompt(n, seed=100 + i, vocab=vocab) for i, n in enumerate(lengths)]


def check_mixed_batch_two_pools(path: str, ref, greedy, vocab: int, window_blocks: int) -> LLM:
    """check_mixed_batch for a model with a window pool (DeepSeek-V4 / V4.1, engine/block_manager.py): 16 main blocks
    (one max_model_len=128 sequence) and `window_blocks` window blocks, so that both pools run out."""
    probe = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8, max_model_len=128,
                max_num_batched_tokens=24)
    runner = probe.engine.runner
    budget = 16 * runner.kv_bytes_per_block() + window_blocks * runner.window_bytes_per_block()
    llm = check_mixed_batch(path, ref, runner.kv_bytes_per_token(), greedy=greedy, vocab=vocab, budget_bytes=budget,
                            max_model_len=128)
    bm = llm.engine.block_manager
    assert bm.num_window_blocks == window_blocks and bm.num_blocks == (16 if runner.kv_bytes_per_block() else 256 * 16)
    return llm


def check_mixed_batch(path: str, hf, kv_bytes_per_token: float, steps: int = 32, greedy=None,
                      vocab: int = VOCAB, budget_bytes: int | None = None, **engine_kwargs) -> LLM:
    """All prompts at once with chunked prefill (24-token steps), prefix caching and a KV budget small
    enough to force preemption: each request's tokens equal the reference's greedy ones (`greedy(model, ids,
    steps)` -> (tokens, logits [steps, V]); default HF's) and each token's logprob agrees with the reference's
    logits (decode steps run batched, some sequences mid-prefill beside them). The budget: 16 blocks of 8 tokens
    (the longest request alone needs 14), or `budget_bytes`."""
    prompts = mixed_prompts(vocab)
    refs = [(greedy or hf_greedy)(hf, ids, steps) for ids in prompts]
    budget_blocks = 16
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8, enable_chunked_prefill=True,
              max_num_batched_tokens=24, enable_prefix_caching=True,
              kv_cache_memory_bytes=budget_bytes or int(budget_blocks * 8 * kv_bytes_per_token), **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, (ref_tokens, ref_logits) in zip(outs, refs):
        got = out.outputs[0].token_ids
        assert got == ref_tokens
        ref_lp = torch.log_softmax(ref_logits, dim=-1)[torch.arange(steps), torch.tensor(got)]
        ours = torch.tensor([entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, got)])
        # Logits agree within 1e-4 of their scale, so log-probabilities within twice that.
        tol = 2e-4 * ref_logits.abs().max().item()
        assert (ours - ref_lp).abs().max().item() <= tol
    assert llm.engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert llm.engine.block_manager.prefix_hits > 0, "the shared prefix was meant to hit the cache"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked after all requests finished"
    assert bm.num_free_window_blocks == bm.num_window_blocks, "window blocks leaked after all requests finished"
    return llm
