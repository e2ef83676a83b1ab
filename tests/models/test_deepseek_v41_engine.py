"""The paged, batched DeepSeek-V4.1 engine model (deepserve/models/deepseek_v41.py) against the plain reference
forward written from the spec (deepserve/models/reference/deepseek_v41.py, the oracle), on tiny random checkpoints
in the released format (FP8 + UE8M0 scales, FP4 experts) written by make_tiny_checkpoint.

Every layer-type mix of tiny_config: window-only, C1, C2, mixed (sparse top-k, shared KV / index / index-K sources,
candidate blocks, YOCO split), shared (a second consumer-half KV source), Engram on, hc_shifted off."""

from __future__ import annotations

import json
import os

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.models.deepseek_v41_config import DeepseekV41Config
from deepserve.models.reference.deepseek_v41 import DeepseekV41Reference
from deepserve.models.reference.tiny import tiny_config
from deepserve.tools.make_tiny_checkpoint import write_deepseek_v41

from tests.worker.eager_graphs import install_eager_replay_graphs
from hf_compare import assert_close_relative, check_mixed_batch_two_pools, engine_logits, random_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS = ("window", "c1", "c2", "mixed", "shared", "engram", "unshifted")
VOCAB = 96


@pytest.fixture(scope="module")
def tiny_v41(tmp_path_factory):
    """variant -> (checkpoint dir, reference model holding the checkpoint's dequantized weights)."""
    made: dict[str, tuple[str, DeepseekV41Reference]] = {}

    def get(variant: str):
        if variant not in made:
            path = str(tmp_path_factory.mktemp(f"v41_{variant}"))
            real = write_deepseek_v41(path, variant, quantize=True)
            ref = DeepseekV41Reference(DeepseekV41Config.from_hf_dict(tiny_config(variant))).eval()
            ref.load_state_dict(real)
            made[variant] = (path, ref)
        return made[variant]
    return get


def reference_logits(ref: DeepseekV41Reference, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return ref(torch.tensor(ids))


def reference_greedy(ref: DeepseekV41Reference, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding by re-running the whole-context reference forward (no cache) each step."""
    tokens, logits = list(ids), []
    for _ in range(steps):
        last = reference_logits(ref, tokens)[-1]
        logits.append(last)
        tokens.append(int(last.argmax()))
    return tokens[len(ids):], torch.stack(logits)


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_and_greedy_match_reference(tiny_v41, variant):
    """Prompt logits whole and in chunks of 5 and 3 (odd: C2 entries split across steps) within 1e-4 of the
    reference, then 32 greedy tokens identical."""
    path, ref = tiny_v41(variant)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8)
    ids = random_prompt(37, seed=1, vocab=VOCAB)
    want = reference_logits(ref, ids)
    for chunk in (None, 5, 3):
        assert_close_relative(engine_logits(llm, ids, chunk=chunk), want)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference_greedy(ref, ids, 32)[0]


# In the default run: the variants whose layers mix the attention kinds (mixed), share KV (shared) or add the engram
# path; the single-kind ones (each also in the logits and greedy tests above) run with -m slow.
SCHEDULING_VARIANTS = [v if v in ("mixed", "shared", "engram") else pytest.param(v, marks=pytest.mark.slow)
                       for v in VARIANTS]


@pytest.mark.parametrize("variant", SCHEDULING_VARIANTS)
def test_batched_with_chunking_preemption_and_prefix_hits(tiny_v41, variant):
    """Six requests at once: chunked prefill, prefix-cache hits and preemption each happen (asserted inside), and
    every token and logprob matches the reference's greedy decoding. The budget: 16 main blocks (one max_model_len
    sequence) and 7 window blocks (a 24-token step and its window need up to 6, a decoding sequence 1-2), so both pools
    run out."""
    path, ref = tiny_v41(variant)
    check_mixed_batch_two_pools(path, ref, reference_greedy, VOCAB, window_blocks=7)


def test_bytes_per_token_of_each_layer_type(tiny_v41):
    """Per block of 8 tokens, fp32 caches (mixed: D=32, Di=16; ratios [0, 2, 2, 1, 1, 1]; kv sources 1, 3;
    index-K sources 1, 3 (5 reads 3's)). Window pool (per position, kept only near each sequence's end): every
    layer's SWA keys 8 x D; a C2 source's fp32 (score, latent) state 8 x 2D, a C1 source's 8 x D. Main pool (the
    whole context): a C2 source 4 entries x D and 4 index keys x Di; a C1 source 8 entries x D and 8 index keys;
    window and sharing layers (0, 2, 4, 5) nothing."""
    path, _ = tiny_v41("mixed")
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8)
    D, Di, f = 32, 16, 4
    swa = 8 * D * f
    window = [swa, swa + 8 * 2 * D * 4, swa, swa + 8 * D * 4, swa, swa]
    main = [0, 4 * D * f + 4 * Di * f, 0, 8 * D * f + 8 * Di * f, 0, 0]
    model = llm.engine.runner.model

    def per_layer(pool):
        return [sum(p.kv_bytes_per_block(torch.float32, 8) for p in block.attn.paged_states() if p.pool == pool)
                for block in model.layers]
    assert per_layer("window") == window and per_layer("main") == main
    runner = llm.engine.runner
    assert runner.window_bytes_per_block() == sum(window) and runner.kv_bytes_per_block() == sum(main)
    # Shared layers alias their source's state: the runner allocated each state once.
    shared = model.layers[2].attn
    assert shared.kv_source_layer is model.layers[1].attn
    assert model.layers[5].attn.index_k_source_layer is model.layers[3].attn


@pytest.mark.parametrize("variant", ["mixed", "engram"])
def test_a_long_sequence_keeps_only_its_window(tiny_v41, variant):
    """A sequence holds its whole context in main blocks but only the window blocks its next rows can read: after
    every step at most those covering the `reach` positions before its next one (ceil((reach + 1) / bs) + 1), while
    the prompt's chunks come and go; all blocks come back at the end. The tokens are still the reference's."""
    path, ref = tiny_v41(variant)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8, max_num_batched_tokens=16)
    engine, bm = llm.engine, llm.engine.block_manager
    reach = engine.runner.model.window_reach()
    assert reach == 3                           # W - 1 = 3 (a C2 compressor reads 1 back, Engram's 3-gram history 2)
    ids = random_prompt(45, seed=3, vocab=VOCAB)
    engine.add_request("long", {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=40,
                                                                          ignore_eos=True))
    held, tokens = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        for seq in engine.scheduler.running:
            held.append((len(seq.block_table), sum(1 for b in seq.window_table if b >= 0)))
    bound = -(-(reach + 1) // 8) + 1
    assert max(w for _, w in held) <= bound and max(m for m, _ in held) == -(-(45 + 39) // 8)
    assert tokens == reference_greedy(ref, ids, 40)[0]
    assert bm.num_free_window_blocks == bm.num_window_blocks and bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("variant", ["mixed", "c2"])
def test_prefix_hit_brings_back_a_window_of_several_blocks(tiny_v41, variant):
    """Blocks of 2 tokens, window 4 (reach 3): a hit at position p reads window states from p - 3 on, two blocks back.
    A second request sharing 21 tokens with a finished one hits 10 blocks and adopts the two window blocks before
    them, and its logits and greedy tokens are still the reference's."""
    path, ref = tiny_v41(variant)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=2, max_num_batched_tokens=16)
    shared = random_prompt(21, seed=11, vocab=VOCAB)
    first, second = shared + random_prompt(6, seed=12, vocab=VOCAB), shared + random_prompt(9, seed=13, vocab=VOCAB)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate({"prompt_token_ids": first}, params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.find_cached_prefix(_probe(second)) and bm.window_reach == 3
    out = llm.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 20
    assert out.outputs[0].token_ids == reference_greedy(ref, second, 12)[0]


def _probe(ids: list[int]):
    from deepserve.sequence import Sequence
    return Sequence(10**9 + len(ids), "probe", 0, ids, SamplingParams(), seed=0)


def test_quantized_checkpoint_loads_the_dequantized_weights(tmp_path):
    """The engine's parameters are exactly the checkpoint's dequantized values (FP8 projections, FP4 experts,
    fp32 HC and sinks), under the engine's names."""
    real = write_deepseek_v41(str(tmp_path), "mixed", quantize=True)
    model = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32").engine.runner.model
    params = dict(model.named_parameters())
    assert torch.equal(params["layers.3.attn.wq_a.weight"], real["layers.3.attn.wq_a.weight"])
    assert torch.equal(params["layers.0.hc_attn.fn"], real["layers.0.hc_attn_fn"])
    w13 = params["layers.2.ffn.w13"][5]
    assert torch.equal(w13, torch.cat((real["layers.2.ffn.experts.5.w1.weight"],
                                       real["layers.2.ffn.experts.5.w3.weight"])))
    assert torch.equal(params["layers.1.ffn.gate.e_score_correction_bias"], real["layers.1.ffn.gate.bias"])
    assert torch.equal(params["mtp.0.main_proj.weight"], real["mtp.0.main_proj.weight"])   # drafts kept


@pytest.mark.parametrize("edit, field", [
    (dict(compress_ratios=[0, 2, 3, 1, 1, 1, 0]), "compress_ratios"),
    (dict(kv_source_layer_ids=[1, 2]), "kv_source_layer_ids"),   # layer 3 (consumer) would read producer 2
    (dict(sliding_window=None), "sliding_window"),
])
def test_bad_configs_fail_at_load_naming_the_field(tmp_path, edit, field):
    write_deepseek_v41(str(tmp_path), "mixed", quantize=False)
    with open(os.path.join(tmp_path, "config.json")) as f:
        config = json.load(f)
    for key, value in edit.items():
        if value is None:
            config["text_config"].pop(key)
        else:
            config["text_config"][key] = value
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=field):
        LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32")


def test_engram_with_a_compressed_vocabulary(tmp_path):
    """engram_compressed_vocab_size set: the engine builds the compressed vocabulary from the checkpoint's
    tokenizer.json (§2.9) and matches the reference given the same map (built here from the tokenizer itself)."""
    from deepserve.models.engram_hashing import engram_compressed_ids
    from deepserve.tools.make_tiny_checkpoint import build_tokenizer

    tok = build_tokenizer(VOCAB)
    cids = engram_compressed_ids([tok.decode([i], skip_special_tokens=False) for i in range(VOCAB)],
                                 [tok.id_to_token(i) or "" for i in range(VOCAB)])
    vc = max(cids) + 1
    assert vc < VOCAB                        # lower/upper case letters share keys: a real compression
    real = write_deepseek_v41(str(tmp_path), "engram", quantize=False, engram_compressed_vocab_size=vc)
    ref = DeepseekV41Reference(DeepseekV41Config.from_hf_dict(
        tiny_config("engram", engram_compressed_vocab_size=vc))).eval()
    ref.load_state_dict(real)
    ref.set_engram_vocab(cids)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", block_size=8)
    assert llm.engine.runner.model.engram_vocab.tolist() == cids
    ids = random_prompt(30, seed=5, vocab=VOCAB)
    assert_close_relative(engine_logits(llm, ids, chunk=7), reference_logits(ref, ids))


@pytest.mark.parametrize("variant", ["mixed", "shared", "engram", "unshifted", "c2"])
def test_captured_decode_path_matches_reference(tiny_v41, variant):
    """Decode steps through the CUDA-graph runner's static batches (replayed eagerly on the CPU): three sequences
    padded to four rows, context buckets of 32 / 64 / 128 keys crossed while decoding (the later ones captured
    when first needed). Every greedy token equals the reference's, and the padding rows' writes (slot -1, the
    scratch block) leave every block free afterwards."""
    _captured_decode_matches_reference(tiny_v41, variant)


@pytest.mark.parametrize("mapped", [False, True], ids=["copied", "mapped"])
def test_captured_decode_with_compact_tables_and_carried_tokens(tiny_v41, monkeypatch, mapped):
    """The same through graphs whose block and window tables travel packed at the step's width (unpacked by the
    replay) and that carry their greedy argmax to the next replay under overlapped scheduling: the reference's
    tokens (late captures of the wider buckets included). `mapped` (DEEPSERVE_MAPPED_STEP_IO): the replays load
    both tables a row from the host buffers themselves, the late captures warmed up on the padding buffer while a
    replay is in flight."""
    monkeypatch.setenv("DEEPSERVE_GRAPH_TOKENS", "1")
    _captured_decode_matches_reference(tiny_v41, "mixed", async_scheduling=True, compact_tables=True, mapped=mapped)


def _captured_decode_matches_reference(tiny_v41, variant, async_scheduling=False, compact_tables=False,
                                       mapped=False):
    path, ref = tiny_v41(variant)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8, max_model_len=128,
              async_scheduling=async_scheduling)
    graphs = install_eager_replay_graphs(llm, [32, 64, 128], compact_tables=compact_tables,
                                         carry_tokens=async_scheduling, mapped_io=mapped)
    assert graphs.inputs.compact == compact_tables and graphs.inputs.window_tables is not None
    assert graphs.mapped == mapped and (not mapped or graphs.inputs.tables_per_row == 2)
    prompts = [random_prompt(n, seed=n, vocab=VOCAB) for n in (37, 9, 21)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(ref, ids, 30)[0]
    assert graphs.num_replays >= 25
    assert {bucket for _, bucket in graphs.graphs} == {32, 64, 128}     # 9 + 30 tokens: 32 -> 64; 37 + 30: 128
    assert set(graphs.turn_graphs) == (set(graphs.graphs) if mapped else set())
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_fp8_kv_cache_is_refused_for_paged_states(tiny_v41):
    """DeepSeek-V4.1's paged states (compressed and windowed caches) keep the model's dtype: kv_cache_dtype fp8 is
    refused with the reason, not run in another dtype."""
    path, _ = tiny_v41("window")
    with pytest.raises(ValueError, match="paged states"):
        LLM(path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8")
