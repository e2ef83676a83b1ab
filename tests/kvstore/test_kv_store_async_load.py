"""Store loads off the engine thread (kvstore/fetcher.py, engine/kv_store_connector.py): real engines over a real disk
tier, slowed or broken by a subclass where a test needs it.

- a running decode keeps producing tokens in the steps while a long prompt's blocks are fetched, and the long prompt
  then hits the store (>= 90% cached) with the greedy tokens of an engine without a store;
- a fetch that fails (corrupt entry, entry gone after the lookup, a tier raising) falls back to computing the rest;
- an abort during a fetch leaves no blocks held, no bytes reserved, nothing hanging;
- the fetch byte cap holds: a fetch larger than it alone is cut, one that does not fit beside another waits.
"""

from __future__ import annotations

import random
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest
from kv_settings import ENGINE, GREEDY

from deepserve import LLM
from deepserve.config import EngineArgs
from deepserve.engine.block_manager import hash_block
from deepserve.engine.engine import LLMEngine
from deepserve.kvstore.disk_tier import DiskTier
from deepserve.sampling_params import SamplingParams
from deepserve.sequence import SequenceStatus

pytestmark = pytest.mark.usefixtures("one_torch_thread")     # many tiny ops: two OpenMP threads spin on 2 cores

PROMPT_LEN = 600                                # 37 full blocks can come from the store (592 tokens, 98.7%)
STORE_BLOCKS = (PROMPT_LEN - 1) // 16
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4           # layers x (k, v) x tokens x kv heads x head dim x fp32


def make_prompt(seed, length=PROMPT_LEN):
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


LONG, OTHER = make_prompt(10), make_prompt(11)


def chain_hashes(prompt, n, bs=16):
    hashes = []
    for i in range(n):
        hashes.append(hash_block(hashes[-1] if hashes else None, prompt[i * bs:(i + 1) * bs]))
    return hashes


class TestDisk(DiskTier):
    """A real disk tier, slowed by `delay_s` a read; `broken[name]` makes that entry's read fail: "vanish" deletes
    the file first (the lookup saw it: another process evicted it), "raise" raises (a bug, an odd filesystem)."""
    __test__ = False

    def __init__(self, path, max_bytes, delay_s=0.0, broken=None):
        super().__init__(path, max_bytes)
        self.delay_s = delay_s
        self.broken = broken or {}
        self.reads = 0

    def get(self, name):
        self.reads += 1
        time.sleep(self.delay_s)
        how = self.broken.get(name)
        if how == "vanish":
            self.remove(name)
        elif how == "raise":
            raise RuntimeError(f"injected failure reading {name}")
        return super().get(name)


@pytest.fixture(scope="module")
def filled_store(tiny_llama, tmp_path_factory):
    """A disk store holding LONG's and OTHER's blocks, written by another engine."""
    path = tmp_path_factory.mktemp("kv_filled")
    llm = LLM(tiny_llama, **ENGINE, kv_store={"backend": "disk", "path": str(path), "memory_bytes": 0})
    llm.generate([{"prompt_token_ids": p} for p in (LONG, OTHER)], GREEDY, use_tqdm=False)
    assert llm.engine.kv_store.flush(timeout=30)
    llm.engine.kv_store.close()
    return path


@pytest.fixture
def store_dir(filled_store, tmp_path):
    """A copy of the filled store each test may break as it likes."""
    path = tmp_path / "kv"
    shutil.copytree(filled_store, path)
    return path


def engine_on(model, store_dir, delay_s=0.0, broken=None, **kv_store):
    """An engine whose store is the disk directory alone, read through TestDisk."""
    cfg = {"backend": "disk", "path": str(store_dir), "memory_bytes": 0, **kv_store}
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **ENGINE, kv_store=cfg))
    store = engine.kv_store.store
    assert [t.name for t in store.tiers] == ["disk"]
    store.tiers[0] = TestDisk(str(store_dir), store.tiers[0].max_bytes, delay_s, broken)
    assert engine.kv_store.fetcher.block_bytes == BLOCK_BYTES
    return engine


def run(engine, requests, deadline_s=60.0, each_step=None):
    """Add (request id, prompt, params) and step until all finished; the finished outputs by id."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    done, deadline = {}, time.monotonic() + deadline_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish its requests"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if each_step is not None:
            each_step()
    return done


def check_blocks(engine):
    """Block-manager invariants, and no waiting sequence (fetching or not) holds a block."""
    bm = engine.block_manager
    holders = Counter(b for seq in engine.scheduler.running for b in seq.block_table)
    assert all(not seq.block_table for seq in engine.scheduler.waiting)
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id]
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)
    for h, b in bm.cached.items():
        assert bm.blocks[b].block_hash == h


def check_idle(engine):
    """Nothing left behind: every block free, no fetch running, no fetch bytes reserved."""
    deadline = time.monotonic() + 10
    while engine.kv_store.fetcher.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.01)
    m = engine.get_stats().kv_store
    assert m["fetches_in_flight"] == 0 and m["fetch_bytes_reserved"] == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.scheduler.has_unfinished()


def test_decode_keeps_producing_tokens_while_a_long_prompt_is_fetched(tiny_llama, reference, store_dir):
    delay_s = 0.02                                  # a read: the whole fetch takes >= 37 x 20 ms
    engine = engine_on(tiny_llama, store_dir, delay_s)
    decode_params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    short = make_prompt(12, length=20)
    engine.add_request("decode", {"prompt_token_ids": short}, decode_params)
    decoder = engine.requests["decode"].seqs[0]
    while len(decoder.token_ids) == len(short):     # until it decodes
        engine.step()
    engine.add_request("long", {"prompt_token_ids": LONG}, GREEDY)
    long_seq = engine.requests["long"].seqs[0]
    fetch_steps, tokens_meanwhile = 0, 0
    done = {}
    while engine.has_unfinished_requests():
        fetching = long_seq.status is SequenceStatus.WAITING and engine.kv_store.fetcher.num_unfinished > 0
        before = len(decoder.token_ids)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if fetching:
            fetch_steps += 1
            tokens_meanwhile += len(decoder.token_ids) - before
        check_blocks(engine)
    assert fetch_steps >= 5 and tokens_meanwhile >= 5, (fetch_steps, tokens_meanwhile)
    assert done["long"].num_cached_tokens >= 0.9 * len(LONG)
    assert done["long"].outputs[0].token_ids == reference(LONG)
    assert done["decode"].outputs[0].token_ids == reference(short, decode_params)
    m = engine.get_stats().kv_store
    assert m["blocks_loaded"] == STORE_BLOCKS and m["load_failures"] == 0
    assert m["fetch_s"] >= STORE_BLOCKS * delay_s
    assert m["admission_load_s"] < 0.25 * m["fetch_s"], m       # the engine thread only copied blocks in
    from deepserve.serving.openai.metrics import kv_store_metrics
    families = {f.name: f.samples[0].value for f in kv_store_metrics("m", m) if not f.samples[0].labels.get("tier")}
    assert families["deepserve:kv_store_fetch_seconds"] == m["fetch_s"]
    assert families["deepserve:kv_store_admission_load_seconds"] == m["admission_load_s"]
    check_idle(engine)


@pytest.mark.parametrize("how", ["corrupt", "vanish", "raise"])
def test_a_failed_fetch_falls_back_to_compute(tiny_llama, reference, store_dir, how):
    victim_hash = chain_hashes(LONG, 11)[10]
    engine = engine_on(tiny_llama, store_dir)
    name = engine.kv_store.name(victim_hash)
    tier = engine.kv_store.store.tiers[0]
    if how == "corrupt":
        path = Path(tier.path_of(name))
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        tier.broken[name] = how
    done = run(engine, [("long", LONG, GREEDY)], each_step=lambda: check_blocks(engine))
    assert done["long"].outputs[0].token_ids == reference(LONG)
    assert done["long"].num_cached_tokens == 10 * 16          # blocks 0-9 fetched, 10 failed, the rest computed
    m = engine.get_stats().kv_store
    assert m["load_failures"] == 1 and m["blocks_loaded"] == 10
    assert m["checksum_failures"] == (1 if how == "corrupt" else 0)
    check_idle(engine)


def test_abort_during_a_fetch_leaves_nothing_behind(tiny_llama, reference, store_dir):
    engine = engine_on(tiny_llama, store_dir, delay_s=0.05)
    engine.add_request("long", {"prompt_token_ids": LONG}, GREEDY)
    engine.step()                                   # starts the fetch; the sequence waits
    assert engine.kv_store.fetcher.num_unfinished == 1 and engine.scheduler.num_waiting == 1
    engine.abort_request("long")
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    check_idle(engine)                              # the worker stopped at its next block and gave its bytes back
    tier = engine.kv_store.store.tiers[0]
    assert tier.reads < STORE_BLOCKS                # it did stop early
    m = engine.get_stats().kv_store
    assert m["fetches_dropped"] == 1 and m["blocks_loaded"] == 0
    assert engine.step() == []                      # nothing left to step, nothing hangs
    tier.delay_s = 0.0                              # the engine still serves the prompt from the store
    done = run(engine, [("again", LONG, GREEDY)])
    assert done["again"].num_cached_tokens >= 0.9 * len(LONG)
    assert done["again"].outputs[0].token_ids == reference(LONG)
    check_idle(engine)


def test_a_fetch_larger_than_the_byte_cap_alone_is_cut_to_it(tiny_llama, reference, store_dir):
    engine = engine_on(tiny_llama, store_dir, max_fetch_bytes=10 * BLOCK_BYTES)
    done = run(engine, [("long", LONG, GREEDY)])
    assert done["long"].num_cached_tokens == 10 * 16
    assert done["long"].outputs[0].token_ids == reference(LONG)
    assert engine.get_stats().kv_store["fetch_bytes_high_water"] == 10 * BLOCK_BYTES
    check_idle(engine)


def test_a_fetch_that_does_not_fit_beside_another_waits_for_its_bytes(tiny_llama, reference, store_dir):
    cap = 40 * BLOCK_BYTES                          # one prompt's 37 blocks fit, two do not
    engine = engine_on(tiny_llama, store_dir, delay_s=0.005, max_fetch_bytes=cap)
    reserved = []
    done = run(engine, [("a", LONG, GREEDY), ("b", OTHER, GREEDY)],
               each_step=lambda: reserved.append(engine.kv_store.fetcher.budget.reserved))
    for request_id, prompt in (("a", LONG), ("b", OTHER)):
        assert done[request_id].num_cached_tokens >= 0.9 * len(prompt)
        assert done[request_id].outputs[0].token_ids == reference(prompt)
    m = engine.get_stats().kv_store
    assert m["fetches_deferred"] >= 1 and m["blocks_loaded"] == 2 * STORE_BLOCKS
    assert max(reserved) <= cap and m["fetch_bytes_high_water"] <= cap
    check_idle(engine)


def test_a_request_behind_a_fetching_one_is_admitted_meanwhile(tiny_llama, reference, store_dir):
    engine = engine_on(tiny_llama, store_dir, delay_s=0.02)
    short = make_prompt(13, length=40)
    engine.add_request("long", {"prompt_token_ids": LONG}, GREEDY)
    engine.add_request("short", {"prompt_token_ids": short}, GREEDY)
    long_seq = engine.requests["long"].seqs[0]
    order, deadline = [], time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        order += [(out.request_id, out) for out in engine.step() if out.finished]
        if "short" not in dict(order):
            assert long_seq.status is SequenceStatus.WAITING        # still fetching while the short one runs
    done = dict(order)
    assert [request_id for request_id, _ in order] == ["short", "long"]
    assert done["short"].outputs[0].token_ids == reference(short)
    assert done["long"].outputs[0].token_ids == reference(LONG)
    assert done["long"].num_cached_tokens >= 0.9 * len(LONG)
    check_idle(engine)


def test_a_fetch_past_its_timeout_is_given_up_and_the_prompt_computed(tiny_llama, reference, store_dir):
    engine = engine_on(tiny_llama, store_dir, delay_s=0.1, fetch_timeout_s=0.3)      # 37 reads: >= 3.7 s
    started = time.monotonic()
    done = run(engine, [("long", LONG, GREEDY)], each_step=lambda: check_blocks(engine))
    assert time.monotonic() - started < 3.0                    # admitted once the timeout passed, not after the fetch
    assert done["long"].outputs[0].token_ids == reference(LONG)
    assert done["long"].num_cached_tokens == 0
    m = engine.get_stats().kv_store
    assert m["fetches_timed_out"] == 1 and m["blocks_loaded"] == 0
    check_idle(engine)                              # the worker stopped at its next block, gave its bytes back


def test_sequences_sharing_a_prefix_fetch_it_once(tiny_llama, reference, store_dir):
    engine = engine_on(tiny_llama, store_dir, delay_s=0.005)
    two = SamplingParams(n=2, max_tokens=8, temperature=0.0, ignore_eos=True)
    done = run(engine, [("pair", LONG, two), ("single", LONG, GREEDY)], each_step=lambda: check_blocks(engine))
    assert [o.token_ids for o in done["pair"].outputs] == [reference(LONG)] * 2
    assert done["single"].outputs[0].token_ids == reference(LONG)
    assert done["pair"].num_cached_tokens >= 0.9 * len(LONG) and done["single"].num_cached_tokens >= 0.9 * len(LONG)
    m = engine.get_stats().kv_store
    assert m["fetches"] == 1 and m["blocks_loaded"] == STORE_BLOCKS
    assert engine.kv_store.store.tiers[0].reads == STORE_BLOCKS
    check_idle(engine)
