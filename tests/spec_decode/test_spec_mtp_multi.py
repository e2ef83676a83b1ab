"""DeepSeek-V3 MTP drafting k > 1 tokens a step (the one MTP layer applied again to its own drafts, spec_decode/mtp.py)
through the engine: greedy output equals the engine's without speculation for k = 2 and 3, fixed and confidence
verification lengths, batched and alone, under chunked prefill, prefix-cache hits and preemption; after every step each
running sequence holds exactly its computed tokens' blocks, and none is held after the run.

A random MTP layer almost never guesses the target's argmax, so these tests make it a bigram table of the target's
greedy output (mtp_checkpoint.bigram_mtp): drafts are accepted where the target follows the table, whole chains
included, and rejected elsewhere. (tests/spec_decode/test_spec_mtp.py checks the drafts themselves against a reference.)

Also the host side of the CUDA-graph path, which the CPU cannot capture: a stand-in graph runner that claims every
decode step (CUDAGraphRunner.size_for's rule) and runs it eagerly; the MTP drafts then come from the hidden states that
runner hands back, and equal the eager path's."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.worker.batch_builder import build_forward_batch
from deepserve.worker.cuda_graph import CUDAGraphRunner, GraphReplay
from tests.spec_decode.mtp_checkpoint import bigram_mtp, write_tiny_v3_mtp
from tests.spec_decode.test_spec_engine import check_blocks
from tests.spec_decode.draft_recording import recording

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 48          # <= hidden_size: the bigram MTP needs it
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
CURVE = [[1, 1.0], [8, 1.2], [32, 2.0]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(path, prompts, the greedy output of the engine without speculation)."""
    path = str(tmp_path_factory.mktemp("v3_mtp_bigram"))
    write_tiny_v3_mtp(path, vocab_size=VOCAB)
    ps = prompts()
    plain = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8)
    want = [o.outputs[0].token_ids for o in plain.generate(requests(ps), PARAMS, use_tqdm=False)]
    return path, ps, want


def prompts() -> list[list[int]]:
    """Mixed lengths; the last three share a 17-token prefix (prefix-cache hits at block size 8)."""
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, VOCAB, (17,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (9,), generator=g).tolist()] + [
        shared + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (14, 5, 22)]


def requests(ps: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in ps]


def mtp_llm(checkpoint, k: int, verify_length: str = "fixed", **kw) -> LLM:
    """An engine drafting k tokens with the MTP layer made a bigram table of the expected outputs."""
    path, ps, want = checkpoint
    spec = {"method": "mtp", "num_speculative_tokens": k, "verify_length": verify_length}
    if verify_length == "confidence":
        spec["cost_curve"] = CURVE
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8, speculative_config=spec, **kw)
    bigram_mtp(llm.engine.runner.model, [p[-1:] + w for p, w in zip(ps, want)])
    return llm


def verifications(llm: LLM) -> list[tuple[int, int]]:
    """(drafts verified, drafts accepted) of every sequence-step from now on."""
    seen = []
    record = llm.engine.speculator.record

    def wrapped(seq, num_verified, num_accepted):
        seen.append((num_verified, num_accepted))
        record(seq, num_verified, num_accepted)
    llm.engine.speculator.record = wrapped
    return seen


@pytest.mark.parametrize("verify_length", ["fixed", "confidence"])
@pytest.mark.parametrize("k", [2, 3])
def test_greedy_output_is_the_output_without_speculation(checkpoint, k, verify_length):
    """Batched (chunked prefill, shared prefixes), then the last two alone (prefix-cache hits on the batch's blocks)."""
    _, ps, want = checkpoint
    llm = mtp_llm(checkpoint, k, verify_length, max_num_batched_tokens=16, enable_prefix_caching=True)
    made, verified = recording(llm), verifications(llm)
    batched = llm.generate(requests(ps), PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == want
    for p, w in zip(ps[2:], want[2:]):
        assert llm.generate({"prompt_token_ids": p}, PARAMS, use_tqdm=False)[0].outputs[0].token_ids == w
    assert max(len(d[2]) for d in made) == k
    assert (k, k) in verified, "no step accepted a whole chain of k drafts"
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    longest = max(batched, key=lambda o: o.metrics.spec_num_accepted_tokens).metrics
    assert longest.mean_accepted_length > 1.0
    bm = llm.engine.block_manager
    assert bm.prefix_hits > 0, "the shared prefixes were meant to hit the cache"
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked after all requests finished"


@pytest.mark.parametrize("k, verify_length", [(3, "fixed"), (2, "confidence")])
def test_preemption_and_prefix_hits_with_drafts_in_flight(checkpoint, k, verify_length):
    """A KV cache of 12 blocks for eight requests (the longest needs 8): sequences are preempted with drafts in
    flight and recompute; the second four repeat the first four's prompts (prefix-cache hits). Block invariants are
    checked after every step; the tokens are those without speculation."""
    _, ps, want = checkpoint
    block_bytes = mtp_llm(checkpoint, k).engine.runner.kv_bytes_per_block()
    llm = mtp_llm(checkpoint, k, verify_length, max_num_batched_tokens=16, kv_cache_memory_bytes=12 * block_bytes)
    engine = llm.engine
    assert engine.block_manager.num_blocks == 12
    done, steps = {}, 0
    for i, p in enumerate(ps):
        engine.add_request(str(i), {"prompt_token_ids": p}, PARAMS)
    while engine.has_unfinished_requests():
        if steps == 3:
            for i, p in enumerate(ps, start=len(ps)):
                engine.add_request(str(i), {"prompt_token_ids": p}, PARAMS)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
        check_blocks(engine.block_manager, engine.scheduler.running)
        steps += 1
    assert [done[i] for i in range(2 * len(ps))] == want + want
    stats = engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


class EagerGraphs(CUDAGraphRunner):
    """Stands in for the decode CUDA graphs on the CPU: `size_for` is CUDAGraphRunner's (every decode step of up to
    64 rows, no prompt logprobs), `run` computes the step eagerly and hands back a GraphReplay as a replay does:
    logits and the hidden state of every scheduled position, in order."""

    def __init__(self, runner) -> None:
        self.runner, self.sizes, self.num_replays = runner, [8, 16, 64], 0
        self.buckets = [runner.config.scheduler.max_model_len]
        self.graphs = {(size, self.buckets[0]): None for size in self.sizes}
        self.mixed_graphs = {}          # none with an MTP drafter (it reads every row's hidden state)

    def run(self, out, key: tuple[int, int], patch_inflight=None, carried=None) -> GraphReplay:
        r = self.runner
        batch = build_forward_batch(out, r.block_size, r.device, [list(range(s.num_new_tokens)) for s in out.scheduled])
        assert not batch.inflight_rows, "a speculating engine does not overlap steps"
        batch.attn_metadata = r.attn_backend.build_metadata(batch)
        hidden = r.model(batch)
        self.num_replays += 1
        return GraphReplay(r.model.compute_logits(hidden), hidden, batch, [])


@pytest.mark.parametrize("k", [1, 3])
def test_graph_replayed_decode_steps_draft_from_the_kept_hidden_states(checkpoint, k):
    _, ps, want = checkpoint
    eager = mtp_llm(checkpoint, k, max_num_batched_tokens=16)
    eager_drafts = recording(eager)
    assert [o.outputs[0].token_ids for o in eager.generate(requests(ps), PARAMS, use_tqdm=False)] == want
    graphed = mtp_llm(checkpoint, k, max_num_batched_tokens=16)
    graphs = graphed.engine.runner.cuda_graphs = EagerGraphs(graphed.engine.runner)
    graphed_drafts = recording(graphed)
    assert [o.outputs[0].token_ids for o in graphed.generate(requests(ps), PARAMS, use_tqdm=False)] == want
    assert graphs.num_replays > 10, "decode steps were meant to take the graph path"
    assert [d[:3] for d in graphed_drafts] == [d[:3] for d in eager_drafts]
    for g, e in zip(graphed_drafts, eager_drafts):
        assert g[3] == pytest.approx(e[3], abs=1e-5)
    assert graphed.engine.get_stats().spec_decode_num_accepted_tokens > 0
