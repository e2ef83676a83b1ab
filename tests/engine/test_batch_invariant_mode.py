"""Batch-invariant mode (EngineArgs(batch_invariant=True)): a request's tokens, logprobs (top 5) and prompt logprobs
are bitwise the same alone, among 2..64 random companions at a random place in the batch, with chunked-prefill
boundaries at different places and over prefix-cache hits; seeded sampling draws the same tokens.

Two tiny models: head_dim 32 runs attention through the C decode kernel, head_dim 16 (tiny_llama) through the
row-by-row PyTorch fallback; and one check on the default model. The default mode is shown to differ on the same
batches (skipped where this host's BLAS happens to give equal rows, so the mode's test stays meaningful)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepserve import LLM, SamplingParams
from deepserve.kernels import cpu as cpu_kernels

ENGINE = dict(skip_tokenizer_init=True, dtype="float32", block_size=8, seed=0, batch_invariant=True)
VOCAB = 512


def save_tiny(path, config, model_cls, seed: int) -> str:
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)      # sharper logits: greedy decoding not decided by near-ties
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def tiny_llama_d32(tmp_path_factory) -> str:
    """tiny_llama with head_dim 32: the C decode-attention kernel's shapes (head_dim a multiple of 32)."""
    import transformers

    from tests.conftest import TINY
    config = transformers.LlamaConfig(**{**TINY, "head_dim": 32})
    return save_tiny(tmp_path_factory.mktemp("tiny_llama_d32"), config, transformers.LlamaForCausalLM, 1)


@pytest.fixture(scope="module")
def tiny_mixtral_d32(tmp_path_factory) -> str:
    """A tiny Mixtral (8 experts, top 2) with head_dim 32: MoE layers in the mode."""
    import transformers

    from tests.conftest import TINY
    config = transformers.MixtralConfig(**{**TINY, "head_dim": 32}, num_local_experts=8, num_experts_per_tok=2)
    return save_tiny(tmp_path_factory.mktemp("tiny_mixtral_d32"), config, transformers.MixtralForCausalLM, 2)


@pytest.fixture(params=["tiny_llama_d32", "tiny_llama"])
def model_path(request) -> str:
    if request.param == "tiny_llama_d32" and cpu_kernels.library() is None:
        pytest.skip("the C decode-attention kernel is not buildable here")
    return request.getfixturevalue(request.param)


def targets(seed: int = 5, vocab: int = VOCAB):
    """Two requests under test: greedy and seeded sampling, both with logprobs=5 and prompt_logprobs=5."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=gen).tolist()} for n in (45, 23)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, prompt_logprobs=5, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, logprobs=5, prompt_logprobs=5,
                             ignore_eos=True)]
    return prompts, params


def companions(num: int, gen: torch.Generator, vocab: int = VOCAB):
    """`num` random requests: random lengths, greedy or sampled, random output lengths."""
    prompts, params = [], []
    for i in range(num):
        length = int(torch.randint(2, 80, (1,), generator=gen))
        prompts.append({"prompt_token_ids": torch.randint(0, vocab, (length,), generator=gen).tolist()})
        max_tokens = int(torch.randint(1, 14, (1,), generator=gen))
        params.append(SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=100 + i, max_tokens=max_tokens,
                                     ignore_eos=True))
    return prompts, params


def observed(output):
    """Everything the test compares bit for bit: tokens, per-token top-5 logprobs, their sum, prompt logprobs."""
    c = output.outputs[0]
    return c.token_ids, c.logprobs, c.cumulative_logprob, output.prompt_logprobs


def alone(llm: LLM, prompts, params):
    return [observed(llm.generate(p, sp, use_tqdm=False)[0]) for p, sp in zip(prompts, params)]


def in_batch(llm: LLM, prompts, params, num_companions: int, seed: int):
    """The requests at random places among `num_companions` random ones, all in one generate call."""
    gen = torch.Generator().manual_seed(seed)
    all_prompts, all_params = companions(num_companions, gen)
    places = []
    for p, sp in zip(prompts, params):
        place = int(torch.randint(0, len(all_prompts) + 1, (1,), generator=gen))
        places = [q + (q >= place) for q in places] + [place]
        all_prompts.insert(place, p)
        all_params.insert(place, sp)
    outs = llm.generate(all_prompts, all_params, use_tqdm=False)
    return [observed(outs[q]) for q in places]


@pytest.fixture(scope="module")
def references(request):
    return {}


def reference_of(path: str, cache: dict):
    if path not in cache:
        cache[path] = alone(LLM(path, **ENGINE, enable_prefix_caching=False), *targets())
    return cache[path]


@pytest.mark.parametrize("num_companions", [1, 6, 63])
def test_alone_equals_any_batch(model_path, references, num_companions):
    llm = LLM(model_path, **ENGINE)
    got = in_batch(llm, *targets(), num_companions, seed=num_companions)
    assert got == reference_of(model_path, references)


@pytest.mark.parametrize("budget", [13, 32, 50])
def test_chunk_boundaries_anywhere(model_path, references, budget):
    """Prompts split into chunks of `budget` tokens shared with companions: every chunk boundary moves."""
    llm = LLM(model_path, **ENGINE, enable_chunked_prefill=True, max_num_batched_tokens=budget)
    got = in_batch(llm, *targets(), 9, seed=budget)
    assert got == reference_of(model_path, references)


def test_prefix_cache_hits(model_path):
    """A request whose prompt's first blocks were cached by another request's prefill (prompt logprobs bypass the
    cache, so this request asks for logprobs only)."""
    prompts, params = targets()
    shared = prompts[0]["prompt_token_ids"]
    target = {"prompt_token_ids": shared[:40] + [3, 1, 4, 1, 5]}
    sp = SamplingParams(temperature=0.7, seed=11, max_tokens=10, logprobs=5, ignore_eos=True)
    expected = alone(LLM(model_path, **ENGINE, enable_prefix_caching=False), [target], [sp])
    llm = LLM(model_path, **ENGINE, enable_prefix_caching=True)
    llm.generate({"prompt_token_ids": shared[:33] + [7] * 20},
                 SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    out = llm.generate(target, sp, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 32
    assert [observed(out)] == expected
    assert in_batch(llm, [target], [sp], 12, seed=4) == expected


def test_mixture_of_experts(tiny_mixtral_d32):
    """Expert GEMMs see as many rows as tokens chose the expert: alone vs among 40 companions and in chunks."""
    expected = alone(LLM(tiny_mixtral_d32, **ENGINE, enable_prefix_caching=False), *targets())
    assert in_batch(LLM(tiny_mixtral_d32, **ENGINE), *targets(), 40, seed=40) == expected
    chunked = LLM(tiny_mixtral_d32, **ENGINE, enable_chunked_prefill=True, max_num_batched_tokens=29)
    assert in_batch(chunked, *targets(), 9, seed=29) == expected


def test_speculative_decoding_with_fixed_verify_length(tiny_llama_d32):
    """Prompt-lookup drafts (a function of the request's own tokens) verified in full: tokens and logprobs are the
    same alone and in a batch."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "verify_length": "fixed"}
    prompts, params = targets()
    prompts = [{"prompt_token_ids": p["prompt_token_ids"][:12] * 3} for p in prompts]   # repeats: drafts to find
    expected = alone(LLM(tiny_llama_d32, **ENGINE, speculative_config=spec, enable_prefix_caching=False),
                     prompts, params)
    llm = LLM(tiny_llama_d32, **ENGINE, speculative_config=spec)
    assert in_batch(llm, prompts, params, 11, seed=8) == expected
    again = llm.generate(prompts[0], params[0], use_tqdm=False)[0]
    assert again.metrics.spec_num_draft_tokens > 0, "no drafts were verified: the test would prove nothing"
    assert [observed(again)] == expected[:1]


def blas_rows_vary() -> bool:
    """Whether this host's F.linear gives a row different bits alone and among other rows (tiny-model shapes)."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(512, 64, generator=gen), torch.randn(9, 64, generator=gen)
    return not torch.equal(F.linear(x[:1], w)[0], F.linear(x, w)[0])


def test_default_mode_is_not_batch_invariant(tiny_llama_d32):
    """The same comparison with the mode off finds a difference (so the tests above can fail)."""
    if not blas_rows_vary():
        pytest.skip("this host's BLAS gives bitwise equal rows: the default mode cannot be shown to vary here")
    engine = {**ENGINE, "batch_invariant": False}
    expected = alone(LLM(tiny_llama_d32, **engine, enable_prefix_caching=False), *targets())
    got = in_batch(LLM(tiny_llama_d32, **engine), *targets(), 63, seed=63)
    assert got != expected


def test_default_model(default_model_path):
    """SmolLM2-135M (fp32 GGUF): greedy logprobs alone vs among 7 companions, prompt chunks of 24 tokens."""
    vocab = 49152
    prompts, params = targets(seed=9, vocab=vocab)
    engine = {**ENGINE, "max_model_len": 256}
    expected = alone(LLM(default_model_path, **engine, enable_prefix_caching=False), prompts[:1], params[:1])
    llm = LLM(default_model_path, **engine, enable_chunked_prefill=True, max_num_batched_tokens=24)
    gen = torch.Generator().manual_seed(2)
    comp_prompts, comp_params = companions(7, gen, vocab)
    outs = llm.generate(comp_prompts[:3] + prompts[:1] + comp_prompts[3:],
                        comp_params[:3] + params[:1] + comp_params[3:], use_tqdm=False)
    assert [observed(outs[3])] == expected


def test_mode_refuses_what_it_does_not_cover(tiny_llama):
    with pytest.raises(ValueError, match="batch_invariant"):
        LLM(tiny_llama, **ENGINE, quantization="int8")


def test_env_variable_and_argument_reach_the_layers(tiny_llama, monkeypatch):
    """DEEPSERVE_BATCH_INVARIANT=1 is EngineArgs' default; an explicit argument wins; the CLI has the flag."""
    from deepserve.cli import build_parser
    from deepserve.config import EngineArgs
    from deepserve.layers.linear import Linear

    monkeypatch.setenv("DEEPSERVE_BATCH_INVARIANT", "1")
    assert EngineArgs(model=tiny_llama).create_engine_config().model.batch_invariant
    assert not EngineArgs(model=tiny_llama, batch_invariant=False).create_engine_config().model.batch_invariant
    llm = LLM(tiny_llama, skip_tokenizer_init=True)
    linears = [m for m in llm.engine.runner.model.modules() if type(m) is Linear]
    assert linears and all(m.batch_invariant for m in linears)
    assert llm.engine.runner.attn_backend.rows_as_decodes
    monkeypatch.delenv("DEEPSERVE_BATCH_INVARIANT")
    assert not EngineArgs(model=tiny_llama).create_engine_config().model.batch_invariant
    args = build_parser().parse_args(["generate", "hi", "--batch-invariant"])
    assert args.batch_invariant is True


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache(tiny_llama_d32, kv):
    """An fp8 KV cache in the mode: the C kernel's fp8 build reads every row's keys in the same fixed order, so a
    request is bitwise the same alone and among companions, with chunk boundaries moved."""
    reference = alone(LLM(tiny_llama_d32, **ENGINE, kv_cache_dtype=kv, enable_prefix_caching=False), *targets())
    llm = LLM(tiny_llama_d32, **ENGINE, kv_cache_dtype=kv, enable_chunked_prefill=True, max_num_batched_tokens=32)
    assert in_batch(llm, *targets(), 9, seed=3) == reference
