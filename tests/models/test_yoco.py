"""YOCO bounded suffix replay (deepinfer.md §8) on the tiny mixed DeepSeek-V4.1 (window 4, consumer half = layers
3-5): compact == mask on the kept rows, decoding after a compact prefill == after a mask prefill, rows far enough
inside the suffix equal YOCO off (the reference forward), and the bound on KEEP is enforced."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.models.reference.deepseek_v41 import DeepseekV41Reference
from deepserve.models.deepseek_v41_config import DeepseekV41Config
from deepserve.models.reference.tiny import tiny_config
from deepserve.models.yoco import YocoTruncation, minimum_keep
from deepserve.tools.make_tiny_checkpoint import write_deepseek_v41

from hf_compare import engine_logits, random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEEP, PROMPT = 16, 40
WINDOW, CONSUMER_LAYERS = 4, 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v41_yoco"))
    real = write_deepseek_v41(path, "mixed", quantize=False)
    ref = DeepseekV41Reference(DeepseekV41Config.from_hf_dict(tiny_config("mixed"))).eval()
    ref.load_state_dict(real)
    return path, ref


def engine(path: str, monkeypatch, mode: str, keep: int = KEEP) -> LLM:
    monkeypatch.setenv("DEEPSERVE_YOCO_PREFILL_TRUNCATION_MODE", mode)
    monkeypatch.setenv("DEEPSERVE_YOCO_PREFILL_KEEP_TOKENS", str(keep))
    return LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8)


def suffix_logits(llm: LLM, ids: list[int], keep: int, chunk: int | None = None) -> torch.Tensor:
    """Logits of the prompt's last `keep` positions (YOCO's kept rows), the prompt prefilled in chunks."""
    return engine_logits(llm, ids, chunk, first_row=len(ids) - keep)


@pytest.mark.parametrize("chunk", [None, 12])
def test_compact_equals_mask_on_kept_rows(checkpoint, monkeypatch, chunk):
    path, ref = checkpoint
    ids = random_prompt(PROMPT, seed=3, vocab=96)
    mask = suffix_logits(engine(path, monkeypatch, "mask"), ids, KEEP, chunk)
    compact = suffix_logits(engine(path, monkeypatch, "compact"), ids, KEEP, chunk)
    assert mask.shape == (KEEP, 96)
    # The same computation on the kept rows; not bitwise here only because a CPU GEMM's rounding depends on how
    # many rows it multiplies (batch-invariant kernels are a separate mode), hence 1e-5 in fp32.
    torch.testing.assert_close(compact, mask, rtol=0, atol=1e-5)
    with torch.inference_mode():
        off = ref(torch.tensor(ids))[-KEEP:]
    # Not vacuous: the first kept rows lost consumer-window keys, so they differ from YOCO off ...
    assert (mask[:4] - off[:4]).abs().max() > 1e-3
    # ... while rows whose chained consumer windows (W - 1 back per consumer layer) stay inside the suffix equal
    # the whole-context reference forward.
    inside = (WINDOW - 1) * CONSUMER_LAYERS
    torch.testing.assert_close(mask[inside:], off[inside:], rtol=0, atol=1e-4)


def test_decoding_after_compact_prefill_matches_mask(checkpoint, monkeypatch):
    path, _ = checkpoint
    ids = random_prompt(PROMPT, seed=4, vocab=96)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = {}
    for mode in ("mask", "compact"):
        out = engine(path, monkeypatch, mode).generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        outs[mode] = out.outputs[0]
    assert outs["compact"].token_ids == outs["mask"].token_ids
    lp = {m: [e[t].logprob for e, t in zip(o.logprobs, o.token_ids)] for m, o in outs.items()}
    assert max(abs(a - b) for a, b in zip(lp["compact"], lp["mask"])) < 1e-4


def test_prefix_hits_read_only_window_states_every_layer_wrote(checkpoint, monkeypatch):
    """Prefix caching under YOCO. A 40-token prompt A (KEEP 16) writes consumer-layer window states only from
    position 24 on (compact). B1 shares A's first 24 tokens and is short enough that its consumer rows would read
    positions 21-23 of a hit at 24: the window block there is not named, so B1 gets no hit (and compact == mask,
    where a hit would have read states compact never wrote). B2 continues A (prompt + output): it hits 40 tokens,
    whose window block before the hit point A wrote whole; compact == mask again."""
    path, _ = checkpoint
    a = random_prompt(PROMPT, seed=3, vocab=96)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    results, logprobs = {}, {}
    for mode in ("mask", "compact"):
        llm = engine(path, monkeypatch, mode)
        out_a = llm.generate({"prompt_token_ids": a}, params, use_tqdm=False)[0].outputs[0].token_ids
        b1 = a[:24] + random_prompt(4, seed=4, vocab=96)
        b2 = a + out_a + random_prompt(5, seed=5, vocab=96)
        outs = llm.generate([{"prompt_token_ids": b1}, {"prompt_token_ids": b2}], params, use_tqdm=False)
        results[mode] = [(o.num_cached_tokens, o.outputs[0].token_ids) for o in outs]
        logprobs[mode] = torch.tensor([e[t].logprob for o in outs for e, t in zip(o.outputs[0].logprobs,
                                                                                   o.outputs[0].token_ids)])
    assert [cached for cached, _ in results["compact"]] == [0, 40]
    assert results["compact"] == results["mask"]
    torch.testing.assert_close(logprobs["compact"], logprobs["mask"], rtol=0, atol=1e-4)


def test_keep_bound_is_enforced(checkpoint, monkeypatch):
    path, _ = checkpoint
    assert minimum_keep(128, 1 + 5) == 134                  # window 128, 5 draft tokens (§8)
    with pytest.raises(ValueError, match="DEEPSERVE_YOCO_PREFILL_KEEP_TOKENS=4.*>= sliding window"):
        engine(path, monkeypatch, "compact", keep=WINDOW)
    engine(path, monkeypatch, "compact", keep=WINDOW + 1)    # W + 1 (no drafts) is enough


def test_prompt_logprobs_are_refused_under_yoco(checkpoint, monkeypatch):
    llm = engine(checkpoint[0], monkeypatch, "mask")
    with pytest.raises(ValueError, match="prompt_logprobs.*YOCO"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(prompt_logprobs=1), use_tqdm=False)


def test_models_without_consumer_half_refuse_yoco(tmp_path, monkeypatch):
    write_deepseek_v41(str(tmp_path), "c2", quantize=False)
    with pytest.raises(ValueError, match="no YOCO consumer half"):
        engine(str(tmp_path), monkeypatch, "mask")


def test_kept_range():
    y = YocoTruncation("compact", 10)
    assert y.kept_range(q_start=0, q_len=30, data_len=30) == (20, 30)
    assert y.kept_range(q_start=0, q_len=8, data_len=30) == (7, 8)       # wholly before the suffix: placeholder
    assert y.kept_range(q_start=25, q_len=5, data_len=30) == (25, 30)    # wholly inside
    assert y.kept_range(q_start=29, q_len=1, data_len=30) == (29, 30)    # a decode row
    assert YocoTruncation().kept_range(0, 30, 30) == (0, 30)
