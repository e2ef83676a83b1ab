"""DSpark drafting (DeepSeek-V4.1's draft blocks, deepinfer.md §2.10) on tiny V4.1 checkpoints with two draft layers:
every draft and confidence the engine makes (paged main cache, chunked prefill, batching, verification steps, greedy
and sampled requests) equals the plain reference's (deepserve/models/reference/dspark.py, re-run on the whole
context); greedy output with DSpark speculation is the output without it (alone, batched, with prefix-cache hits and
chunked prefill, fixed and confidence verification lengths); no block leaks; a model without draft layers is refused.

A random tiny draft model almost never guesses the target's argmax, so the greedy tests make it: the Markov head is
set to a bigram table of the target's own greedy continuations (embed = c·I, head[next[v], v] = c), so drafts are
accepted where the target follows its bigram and rejected elsewhere: both paths run."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.models.deepseek_v41_config import DeepseekV41Config
from deepserve.models.reference.deepseek_v41 import DeepseekV41Reference
from deepserve.models.reference.dspark import reference_drafts
from deepserve.models.reference.tiny import tiny_config
from deepserve.tools.make_tiny_checkpoint import write_deepseek_v41
from tests.spec_decode.draft_recording import recording

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 96
DRAFT_LAYERS = dict(num_nextn_predict_layers=2, compress_ratios=[0, 2, 2, 1, 1, 1, 0, 0], dspark_markov_rank=VOCAB)


@pytest.fixture(scope="module")
def tiny_dspark(tmp_path_factory):
    """variant -> (checkpoint dir, reference model with the checkpoint's dequantized weights)."""
    made = {}

    def get(variant: str):
        if variant not in made:
            path = str(tmp_path_factory.mktemp(f"dspark_{variant}"))
            real = write_deepseek_v41(path, variant, quantize=True, **DRAFT_LAYERS)
            ref = DeepseekV41Reference(DeepseekV41Config.from_hf_dict(tiny_config(variant, **DRAFT_LAYERS))).eval()
            ref.load_state_dict(real)
            made[variant] = (path, ref)
        return made[variant]
    return get


def prompts(n: int = 4) -> list[list[int]]:
    """Mixed lengths; the last three share a 17-token prefix (prefix-cache hits at block size 8)."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, VOCAB, (17,), generator=g).tolist()
    out = [torch.randint(3, VOCAB, (9,), generator=g).tolist()]
    for length in (14, 5, 22)[:n - 1]:
        out.append(shared + torch.randint(3, VOCAB, (length,), generator=g).tolist())
    return out


def plain_greedy(path: str, ps: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """The tokens of the engine without speculation: what every speculative run must reproduce."""
    plain = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8)
    return [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in ps], params,
                                                           use_tqdm=False)]


def dspark_llm(path: str, k: int = 4, **kw) -> LLM:
    return LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8,
               speculative_config={"method": "dspark", "num_speculative_tokens": k, **kw.pop("spec", {})}, **kw)


@pytest.mark.parametrize("variant", ["mixed", "unshifted"])
def test_drafts_and_confidences_match_the_reference(tiny_dspark, variant):
    """Three greedy requests and a sampled one, batched, chunked (12-token steps): every draft block whose position
    is inside the final sequence equals the reference's tokens and raw confidences."""
    path, ref = tiny_dspark(variant)
    llm = dspark_llm(path, max_num_batched_tokens=12)
    made = recording(llm)
    ps = prompts()
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], [greedy] * 3 + [sampled], use_tqdm=False)
    finals = {i + 1: p + o.outputs[0].token_ids for i, (p, o) in enumerate(zip(ps, outs))}
    checked = {seq_id: 0 for seq_id in finals}
    for seq_id, position, tokens, confs in made:
        final = finals[seq_id]
        if position > len(final):
            continue
        kw = {}
        if seq_id == 4:
            kw = dict(temperature=0.9, top_k=40, seed=5)
        want = reference_drafts(ref, final[:position], len(tokens), **kw)
        assert tokens == want.tokens, (seq_id, position)
        assert confs == pytest.approx(want.confidences, abs=1e-4), (seq_id, position)
        checked[seq_id] += 1
    assert min(checked.values()) >= 5 and sum(checked.values()) >= 30, checked


def bigram_drafter(model, sequences: list[list[int]], c: float = 4.0) -> None:
    """`model`'s Markov head made a bigram table of `sequences` (the last continuation of a token wins)."""
    last = model.mtp[-1].markov_head
    nxt = {}
    for seq in sequences:
        nxt.update(zip(seq[:-1], seq[1:]))
    with torch.no_grad():
        last.embed.weight.copy_(torch.eye(VOCAB) * c)
        last.head.weight.zero_()
        for v, w in nxt.items():
            last.head.weight[w, v] = c


@pytest.mark.parametrize("verify_length", ["fixed", "confidence"])
def test_greedy_output_is_the_output_without_speculation(tiny_dspark, verify_length):
    """Batched (chunked prefill, shared prefixes) then the last two alone again (prefix-cache hits): the tokens
    are those of the engine without speculation; drafts were both accepted and rejected (and still equal the
    reference's, now after accepted ones too); no block leaked."""
    path, ref = tiny_dspark("mixed")
    ps = prompts()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = plain_greedy(path, ps, params)
    spec = {"verify_length": verify_length}
    if verify_length == "confidence":
        spec["cost_curve"] = [[1, 1.0], [8, 1.2], [32, 2.0]]
    llm = dspark_llm(path, max_num_batched_tokens=16, enable_prefix_caching=True, spec=spec)
    finals = [p + w for p, w in zip(ps, want)]
    bigram_drafter(llm.engine.runner.model, finals)
    made = recording(llm)
    batched = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == want
    ref = DeepseekV41Reference(ref.config).eval()
    ref.load_state_dict(tiny_dspark("mixed")[1].state_dict())
    bigram_drafter(ref, finals)
    for seq_id, position, tokens, confs in made[::7]:
        if position <= len(finals[seq_id - 1]):
            want_drafts = reference_drafts(ref, finals[seq_id - 1][:position], len(tokens))
            assert tokens == want_drafts.tokens and confs == pytest.approx(want_drafts.confidences, abs=1e-4)
    for p, w in zip(ps[2:], want[2:]):
        alone = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == w
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    bm = llm.engine.block_manager
    assert bm.prefix_hits > 0, "the shared prefixes were meant to hit the cache"
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked after all requests finished"


def test_main_cache_is_counted_in_the_kv_bytes(tiny_dspark):
    """Each draft layer's SWA state (block of 8 positions x D fp32) joins the window pool's per-block bytes only with
    DSpark on; the main pool is unchanged."""
    path, _ = tiny_dspark("mixed")
    plain = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8).engine.runner
    spec = dspark_llm(path).engine.runner
    assert spec.window_bytes_per_block() - plain.window_bytes_per_block() == 2 * 8 * 32 * 4
    assert spec.kv_bytes_per_block() == plain.kv_bytes_per_block()


def test_dspark_needs_draft_layers_and_at_most_32_drafts(tmp_path, tiny_dspark):
    write_deepseek_v41(str(tmp_path), "mixed", quantize=False, num_nextn_predict_layers=0,
                       compress_ratios=[0, 2, 2, 1, 1, 1])
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        dspark_llm(str(tmp_path))
    path, _ = tiny_dspark("mixed")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        dspark_llm(path, k=33)


def test_greedy_output_under_preemption(tiny_dspark):
    """A KV budget of 11 main blocks and 7 window blocks for four requests (the longest needs 8 main blocks; a 16-token
    step with 4 drafts and its window 5 window blocks): preempted sequences recompute their prompt (main keys
    included) and drafts made for a length they no longer have are dropped; the tokens are unchanged."""
    path, _ = tiny_dspark("mixed")
    ps = prompts()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = plain_greedy(path, ps, params)
    runner = dspark_llm(path, max_model_len=64, max_num_batched_tokens=16).engine.runner
    budget = 11 * runner.kv_bytes_per_block() + 7 * runner.window_bytes_per_block()
    llm = dspark_llm(path, max_num_batched_tokens=16, kv_cache_memory_bytes=budget, max_model_len=64)
    bigram_drafter(llm.engine.runner.model, [p + w for p, w in zip(ps, want)])
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
    bm = llm.engine.block_manager
    assert bm.num_blocks == 11 and bm.num_window_blocks == 7
    assert bm.num_free_blocks == bm.num_blocks and bm.num_free_window_blocks == bm.num_window_blocks


def test_decode_steps_replayed_from_graphs_draft_as_eager_ones(tiny_dspark):
    """The target's decode steps through the CUDA-graph runner's static batches (replayed eagerly on the CPU: the
    stand-in of tests/worker/eager_graphs.py), the DSpark blocks run after each replay from its static
    batch (a block table per position): the same drafts and confidences as the eager engine's, the same tokens
    as without speculation, and graphs did replay."""
    from tests.worker.eager_graphs import install_eager_replay_graphs
    path, _ = tiny_dspark("mixed")
    ps = prompts()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = plain_greedy(path, ps, params)
    finals = [p + w for p, w in zip(ps, want)]
    runs = []
    for graphed in (False, True):
        llm = dspark_llm(path, max_num_batched_tokens=16, max_model_len=128)
        bigram_drafter(llm.engine.runner.model, finals)
        graphs = install_eager_replay_graphs(llm, [128], sizes=(4, 8, 16, 32)) if graphed else None
        made = recording(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
        runs.append(made)
    assert graphs.num_replays > 5
    eager, replayed = ({(seq_id, pos): (tokens, confs) for seq_id, pos, tokens, confs in made} for made in runs)
    assert eager.keys() == replayed.keys()
    for key, (tokens, confs) in eager.items():
        assert replayed[key][0] == tokens and replayed[key][1] == pytest.approx(confs, abs=1e-5), key


def test_sampled_requests_keep_each_drafts_distribution_and_are_reproducible(tiny_dspark):
    """A sampled request's DSpark drafts carry the distribution each was drawn from (the verifier's Q: normalised
    rows, the draft inside their support); greedy drafts carry none; a seeded request gives the same tokens twice,
    and some sampled drafts are accepted."""
    path, _ = tiny_dspark("mixed")
    ps = prompts()
    llm = dspark_llm(path, max_num_batched_tokens=16)
    bigram_drafter(llm.engine.runner.model, ps)
    seen = []
    take = llm.engine.speculator.take_model_drafts

    def record(drafts):
        seen.extend(drafts.values())
        take(drafts)
    llm.engine.speculator.take_model_drafts = record
    sampled = SamplingParams(temperature=0.8, seed=11, max_tokens=20, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in ps], [sampled, greedy, sampled, greedy], use_tqdm=False)
    with_q = [d for d in seen if d.probs is not None]
    assert with_q and len(with_q) < len(seen)               # the sampled requests' drafts only
    for d in with_q:
        assert d.probs.shape == (len(d.token_ids), VOCAB)
        assert torch.allclose(d.probs.sum(-1), torch.ones(len(d.token_ids)), atol=1e-5)
        assert all(d.probs[i, t] > 0 for i, t in enumerate(d.token_ids))
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
    again = llm.generate([{"prompt_token_ids": p} for p in ps], [sampled, greedy, sampled, greedy], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
