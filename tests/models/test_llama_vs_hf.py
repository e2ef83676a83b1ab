"""Engine logits and greedy tokens against HF transformers on the same weights."""

from __future__ import annotations

import os

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.engine.scheduler import ScheduledSequence, SchedulerOutput
from deepserve.engine.sequence import Sequence
from deepserve.worker.forward_batch import ForwardBatch


def engine_logits(llm: LLM, token_ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits at every position, computed through the paged engine path (optionally chunked)."""
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
        batch = ForwardBatch.build(out, runner.block_size, runner.device, [list(range(n))])
        batch.attn_metadata = runner.attn_backend.build_metadata(batch)
        with torch.inference_mode():
            pieces.append(runner.model.compute_logits(runner.model(batch)))
    bm.free(seq)
    return torch.cat(pieces)


def hf_greedy(model, ids: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def assert_close_relative(ours: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rtol * scale, f"max abs error {err:.3e} vs logit scale {scale:.3e}"


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen3", "tiny_qwen2"])
def test_tiny_models_match_hf(kind, request):
    import transformers

    path = request.getfixturevalue(kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (37,), generator=gen).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_close_relative(engine_logits(llm, ids), ref, 1e-4)
    assert_close_relative(engine_logits(llm, ids, chunk=5), ref, 1e-4)   # paged prefix + chunks

    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32)


@pytest.fixture(scope="module")
def hf_smollm(default_model_path):
    import transformers

    d, name = os.path.split(default_model_path)
    return transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, torch_dtype=torch.float32).eval()


def test_default_gguf_model_matches_hf(smollm, hf_smollm):
    tok = smollm.get_tokenizer()
    ids = tok.encode("The capital of France is Paris. The capital of Germany is")
    with torch.no_grad():
        ref = hf_smollm(torch.tensor([ids])).logits[0]
    assert_close_relative(engine_logits(smollm, ids), ref, 1e-4)
    out = smollm.generate({"prompt_token_ids": ids},
                          SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_smollm, ids, 32)
