"""Speculative decoding through the engine: greedy output identical to decoding without drafts (the default model,
a tiny V4.1 against its reference forward), rejected drafts holding no KV blocks after any step, preemption and
prefix-cache hits with drafts in flight, seeded sampling reproducible, and the target's distribution kept."""

from __future__ import annotations

import json

import pytest

from deepserve import LLM, SamplingParams
from deepserve.engine.block_manager import BlockManager

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}

COPY_PROMPTS = [
    "Repeat this sentence twice: the old lighthouse keeper climbed the spiral stairs every evening at dusk.",
    "Copy the list exactly: apples, oranges, pears, plums, cherries, grapes, lemons, limes. Copy: apples,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Write the alphabet in capitals, twice: A B C D E F G H I J K L M N O P Q R S T U V W X Y Z. A B C",
]


@pytest.fixture(scope="module")
def spec_llm(default_model_path):
    return LLM(default_model_path, max_model_len=2048, seed=0, speculative_config=NGRAM)


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def test_greedy_identical_to_no_speculation_alone_and_batched(smollm, spec_llm):
    params = SamplingParams(temperature=0.0, max_tokens=48)
    want = token_ids(smollm.generate(COPY_PROMPTS, params, use_tqdm=False))
    before = spec_llm.engine.get_stats()
    batched = spec_llm.generate(COPY_PROMPTS, params, use_tqdm=False)
    assert token_ids(batched) == want
    alone = [token_ids(spec_llm.generate([p], params, use_tqdm=False))[0] for p in COPY_PROMPTS[:2]]
    assert alone == want[:2]
    stats = spec_llm.engine.get_stats()
    accepted = stats.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    verified = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    assert 0 < accepted < verified          # drafts were verified, most accepted, some rejected
    m = max(batched, key=lambda o: len(o.outputs[0].token_ids)).metrics
    assert m.spec_num_steps > 0 and m.mean_accepted_length > 1.0
    assert m.spec_num_accepted_tokens <= m.spec_num_draft_tokens


def test_text_logprobs_and_stops_match_no_speculation(smollm, spec_llm):
    """Stop strings and max_tokens cut inside a run of accepted drafts at the same place; logprobs agree."""
    params = [SamplingParams(temperature=0.0, max_tokens=40, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=40, stop=["keeper climbed"]),
              SamplingParams(temperature=0.0, max_tokens=7)]
    prompts = [COPY_PROMPTS[0]] * 3
    want = smollm.generate(prompts, params, use_tqdm=False)
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    for w_entry, g_entry in zip(want[0].outputs[0].logprobs, got[0].outputs[0].logprobs):
        assert list(g_entry) == list(w_entry)
        for tok in w_entry:
            assert g_entry[tok].logprob == pytest.approx(w_entry[tok].logprob, abs=1e-4)


def check_blocks(bm: BlockManager, running) -> None:
    """Ref counts equal block-table entries; every running sequence holds exactly the blocks of its computed
    tokens (drafts rejected in the step before hold none)."""
    refs: dict[int, int] = {}
    for seq in running:
        assert len(seq.block_table) == bm.blocks_for_tokens(seq.num_computed_tokens), seq
        for b in seq.block_table:
            refs[b] = refs.get(b, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0)
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)


def test_rejected_drafts_hold_no_blocks_preemption_and_prefix_hits(default_model_path, smollm):
    """A cache too small for every sequence at once: preemption happens with drafts in flight; the second half
    shares the first half's prompts (prefix hits). Invariants are checked after every step; output == no spec."""
    prompts = COPY_PROMPTS + COPY_PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = token_ids(smollm.generate(prompts, params, use_tqdm=False))
    llm = LLM(default_model_path, max_model_len=512, block_size=16, speculative_config=NGRAM,
              kv_cache_memory_bytes=18 * smollm.engine.runner.kv_bytes_per_block())
    engine = llm.engine
    assert engine.block_manager.num_blocks == 18
    done = {}
    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(str(i), prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 3:
            for i, prompt in enumerate(prompts[4:], start=4):
                engine.add_request(str(i), prompt, params)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0].token_ids
        check_blocks(engine.block_manager, engine.scheduler.running)
        steps += 1
    assert [done[i] for i in range(len(prompts))] == want
    stats = engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_reproducible_alone_and_batched(spec_llm):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=32)
    prompt = COPY_PROMPTS[1]
    alone = token_ids(spec_llm.generate([prompt], seeded, use_tqdm=False))[0]
    again = token_ids(spec_llm.generate([prompt], seeded, use_tqdm=False))[0]
    others = [SamplingParams(temperature=1.0, max_tokens=20)] * 3
    batched = token_ids(spec_llm.generate([COPY_PROMPTS[0], prompt, COPY_PROMPTS[2], COPY_PROMPTS[3]],
                                          [others[0], seeded, others[1], others[2]], use_tqdm=False))[1]
    assert alone == again == batched


def test_n_greater_than_one_and_penalised_requests(smollm, spec_llm):
    """n=2 greedy children are identical to each other and to no-spec; a penalised request decodes without
    drafts (the verifier does not apply penalties) and gives the no-spec tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=24, n=2)
    got = spec_llm.generate([COPY_PROMPTS[3]], params, use_tqdm=False)[0]
    want = smollm.generate([COPY_PROMPTS[3]], params, use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    penalised = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3)
    got = spec_llm.generate([COPY_PROMPTS[3]], penalised, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == smollm.generate([COPY_PROMPTS[3]], penalised, use_tqdm=False)[0].outputs[0].token_ids
    assert got.metrics.spec_num_draft_tokens == 0


def test_bad_speculative_config_is_a_clear_error(default_model_path):
    for bad, field in [({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram"}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "verify_length": "auto"}, "verify_length"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "bogus"),
                       ("{not json", "JSON")]:
        with pytest.raises(ValueError, match=field):
            LLM(default_model_path, speculative_config=bad)


def test_structured_requests_speculate_within_their_grammar(smollm, spec_llm):
    """A grammar-constrained request drafts too: its matcher masks every verification row (drafts it refuses are
    dropped or rejected) and advances over the emitted tokens only. Greedy output equals decoding without drafts,
    parses, and drafts were accepted."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "age": {"type": "integer"}}, "required": ["name", "city", "age"]}
    prompt = ('Repeat this JSON exactly: {"name": "Alice Smith", "city": "Paris", "age": 30}. '
              'Then: {"name": "Alice Smith", "city": "Paris", "age": 30}')
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": schema}),
              SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"choice": ["yes", "no"]})]
    prompts = [prompt, "Is the sky blue? Answer yes or no."]
    want = smollm.generate(prompts, params, use_tqdm=False)
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    parsed = json.loads(got[0].outputs[0].text)
    assert set(parsed) == {"name", "city", "age"}
    assert got[1].outputs[0].text in ("yes", "no")
    m = got[0].metrics
    assert m.spec_num_draft_tokens > 0 and m.spec_num_accepted_tokens > 0
