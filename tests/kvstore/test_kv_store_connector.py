"""The KV store in the engine (engine/kv_store_connector.py): real engines, real processes, a real redis-server.

Every output is compared with an engine without a store (greedy: the tokens must be identical); store hits show in
`num_cached_tokens` and in the store's metrics.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from kv_settings import ENGINE, GREEDY

from deepserve import LLM
from deepserve.config import EngineArgs
from deepserve.engine.block_manager import hash_block
from deepserve.engine.engine import LLMEngine
from deepserve.kvstore.codec import decode
from deepserve.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PROMPT_LEN = 600            # 37 full blocks of 16 can come from the store: 592 tokens, 98.7%


def prompts(n, length=PROMPT_LEN, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(length)] for _ in range(n)]


def generate(llm, batch, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)


# --- two engine processes ---------------------------------------------------------------------------------
def run_generate_process(model, kv_store, batch, tmp_path, tag):
    """`deepserve generate --kv-store JSON` in its own process; its JSONL results."""
    src, out = tmp_path / f"{tag}.jsonl", tmp_path / f"{tag}.out.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p, "max_tokens": 8, "ignore_eos": True}) + "\n"
                           for p in batch))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "deepserve.cli", "generate", "--model", model, "--skip-tokenizer-init",
           "--max-model-len", "1024", "--input", str(src), "--output", str(out), "--kv-store", json.dumps(kv_store)]
    r = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def check_second_process_hits(tiny_llama, reference, kv_store, tmp_path):
    batch = prompts(2)
    first = run_generate_process(tiny_llama, kv_store, batch, tmp_path, "first")
    second = run_generate_process(tiny_llama, kv_store, batch, tmp_path, "second")
    for p, a, b in zip(batch, first, second):
        assert a["token_ids"] == b["token_ids"] == reference(p)
        assert a["num_cached_tokens"] == 0
        assert b["num_cached_tokens"] >= 0.9 * len(p)


def test_two_processes_share_a_disk_store(tiny_llama, reference, tmp_path):
    store = tmp_path / "kv"
    check_second_process_hits(tiny_llama, reference, {"backend": "disk", "path": str(store)}, tmp_path)
    assert len(list(store.rglob("*.kv"))) == 2 * 37


def test_two_processes_share_redis(tiny_llama, reference, redis_server, tmp_path):
    check_second_process_hits(tiny_llama, reference, {"backend": "redis", "url": redis_server.url}, tmp_path)


# --- failures ---------------------------------------------------------------------------------------------
def test_corrupt_disk_entry_is_recomputed_and_counted(tiny_llama, reference, tmp_path):
    kv_store = {"backend": "disk", "path": str(tmp_path / "kv"), "memory_bytes": 0}
    batch = prompts(1, seed=1)
    first = LLM(tiny_llama, **ENGINE, kv_store=kv_store)
    generate(first, batch)
    first.engine.kv_store.flush()
    connector = first.engine.kv_store
    name = connector.name(chain_hashes(batch[0], 11)[10])
    victim = Path(connector.store.tiers[0].path_of(name))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF                        # one flipped bit pattern in the middle of the KV
    victim.write_bytes(bytes(data))
    second = LLM(tiny_llama, **ENGINE, kv_store=kv_store)
    out = generate(second, batch)[0]
    assert out.outputs[0].token_ids == reference(batch[0])
    assert out.num_cached_tokens == 10 * 16            # blocks 0-9 loaded; 10 refused; the rest recomputed
    m = second.engine.get_stats().kv_store
    assert m["checksum_failures"] == 1 and m["tiers"]["disk"]["checksum_failures"] == 1
    assert m["load_failures"] == 1
    second.engine.kv_store.flush()                      # the recomputed block was saved again, intact
    assert len(decode(name, victim.read_bytes())) == 2


def chain_hashes(prompt, n, bs=16):
    hashes = []
    for i in range(n):
        hashes.append(hash_block(hashes[-1] if hashes else None, prompt[i * bs:(i + 1) * bs]))
    return hashes


def test_redis_killed_mid_run_then_restarted(tiny_llama, reference, redis_server):
    kv_store = {"backend": "redis", "url": redis_server.url, "memory_bytes": 0, "retry_interval_s": 0.2}
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE, kv_store=kv_store))
    batch = prompts(3, seed=2)
    for i, p in enumerate(batch):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    results = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        steps += 1
        if steps == 2:
            redis_server.kill()                        # mid-run: prompts computed, decodes going on
    assert [results[str(i)].outputs[0].token_ids for i in range(3)] == [reference(p) for p in batch]
    engine.kv_store.flush()
    assert engine.get_stats().kv_store["tiers"]["redis"]["errors"] >= 1     # the saves at finish met a dead server

    # Down: a fresh prompt is computed (a miss), correctly, without an exception.
    engine.block_manager.reset_prefix_cache()
    again = run_engine(engine, batch[:1])
    assert again[0].outputs[0].token_ids == reference(batch[0]) and again[0].num_cached_tokens == 0

    redis_server.start()                               # back, empty (no persistence)
    time.sleep(0.3)
    fresh = prompts(1, seed=3)
    run_engine(engine, fresh)                           # computed and saved now that the server is back
    engine.kv_store.flush()
    engine.block_manager.reset_prefix_cache()
    hit = run_engine(engine, fresh)[0]
    assert hit.outputs[0].token_ids == reference(fresh[0]) and hit.num_cached_tokens >= 0.9 * PROMPT_LEN
    assert engine.kv_store.store.tiers[0].reconnects == 1


def run_engine(engine, batch, params=GREEDY):
    ids = []
    for p in batch:
        ids.append(f"r{engine._next_seq_id}-{len(ids)}")
        engine.add_request(ids[-1], {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


# --- block manager invariants, eviction saves, tier bounds -----------------------------------------------
def check_block_invariants(engine):
    bm = engine.block_manager
    holders = Counter(b for seq in engine.scheduler.running for b in seq.block_table)
    assert all(not seq.block_table for seq in engine.scheduler.waiting)
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id]                     # no leaked or missing reference
        assert (block.ref_count == 0) == (block.block_id in bm.free_queue)    # never handed out twice
    for h, b in bm.cached.items():
        assert bm.blocks[b].block_hash == h


def test_invariants_hold_through_preemption_eviction_saves_and_loads(tiny_llama, reference):
    per_block = 2 * 2 * 16 * 2 * 16 * 4                  # layers x (k, v) x tokens x kv heads x head dim x fp32
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE, kv_cache_memory_bytes=30 * per_block,
                                                   kv_store={"backend": "memory"}))
    assert engine.block_manager.num_blocks == 30
    batch = prompts(3, length=150, seed=4)              # 10 blocks each, growing to 16: not all three fit
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        check_block_invariants(engine)
    assert engine.scheduler.num_preemptions > 0
    m = engine.get_stats().kv_store
    assert m["saved_on_evict"] > 0 and m["blocks_loaded"] > 0      # a preempted sequence came back from the store
    for i, p in enumerate(batch):
        assert results[str(i)].outputs[0].token_ids == reference(p, params)
    assert engine.block_manager.num_free_blocks == 30


def test_memory_tier_bound_evicts(tiny_llama, reference):
    entry = 2 * 2 * 16 * 2 * 16 * 4 + 200                # one block's KV plus the header and metadata
    llm = LLM(tiny_llama, **ENGINE, kv_store={"backend": "memory", "memory_bytes": 40 * entry})
    batch = prompts(2, seed=5)                           # 74 blocks to save, room for 40
    outs = generate(llm, batch)
    llm.engine.kv_store.flush()
    m = llm.engine.get_stats().kv_store["tiers"]["memory"]
    assert m["evictions"] >= 34 and m["used_bytes"] <= 40 * entry
    llm.reset_prefix_cache()
    again = generate(llm, batch)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again] == \
        [reference(p) for p in batch]
    assert again[0].num_cached_tokens == 0               # its first blocks were the ones evicted


def test_fp8_cache_blocks_round_trip_through_the_store(tiny_llama):
    """kv_cache_dtype="fp8": blocks go to the store as their fp8 bytes (an entry a quarter of the fp32 one's KV) and
    come back as the same codes: after the prefix cache is dropped, every request hits the store and decodes the
    tokens an fp8 engine without a store decodes."""
    batch = prompts(2, seed=9)
    plain = LLM(tiny_llama, **ENGINE, kv_cache_dtype="fp8")
    want = [o.outputs[0].token_ids for o in generate(plain, batch)]
    del plain
    llm = LLM(tiny_llama, **ENGINE, kv_cache_dtype="fp8", kv_store={"backend": "memory"})
    assert [o.outputs[0].token_ids for o in generate(llm, batch)] == want
    llm.engine.kv_store.flush()
    memory = llm.engine.get_stats().kv_store["tiers"]["memory"]
    fp8_block_kv = 2 * 2 * 16 * 2 * 16                  # layers x (k, v) x block x kv heads x head dim, one byte each
    assert memory["used_bytes"] < 74 * (fp8_block_kv + 400)
    llm.reset_prefix_cache()
    again = generate(llm, batch)
    assert [o.outputs[0].token_ids for o in again] == want
    assert all(o.num_cached_tokens >= 0.9 * len(p) for o, p in zip(again, batch))
