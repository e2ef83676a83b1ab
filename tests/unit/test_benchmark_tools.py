"""The GPU benchmarks' host-side logic, checked without a GPU: what a tile spec means (fp8_attention_kernels.py,
decode_attention_in_step.py), that a profile's batch keeps decoding and what its graph timeline adds up
(profile_gpu_step.py), which settings an A/B sweep runs (ab_env_sweep.py) and what a 1B layer's kernels cost
against their bytes (price_kernels_1b.py)."""

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def benchmarks_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", ["benchmark"])


def test_attention_tile_specs(benchmarks_on_path):
    from fp8_attention_kernels import parse_tiles
    def spec(n, w, st, early_v=False, heads_first=False, values_t=False, kv_heads=1, maxnreg=None, num_splits=None):
        return {"block_n": n, "num_warps": w, "num_stages": st, "early_v": early_v, "heads_first": heads_first,
                "values_t": values_t, "kv_heads": kv_heads, "maxnreg": maxnreg, "num_splits": num_splits}
    assert parse_tiles("32x4x3") == spec(32, 4, 3)
    assert parse_tiles("64x4x2e") == spec(64, 4, 2, early_v=True)         # GQA: values loaded with the keys
    assert parse_tiles("64x4x3eh") == spec(64, 4, 3, early_v=True, heads_first=True)    # GQA: heads side by side
    assert parse_tiles("64x4x3h") == spec(64, 4, 3, heads_first=True)
    assert parse_tiles("64x4x3eht") == spec(64, 4, 3, early_v=True, heads_first=True, values_t=True)  # values^T
    assert parse_tiles("64x4x3ehp") == spec(64, 4, 3, early_v=True, heads_first=True, kv_heads=2)   # KV head pairs
    assert parse_tiles("64x4x2hr96") == spec(64, 4, 2, heads_first=True, maxnreg=96)     # GQA: a register cap
    assert parse_tiles("32x4x2r168") == spec(32, 4, 2, maxnreg=168)       # MLA: a register cap
    assert parse_tiles("16x4x3R128") == spec(16, 4, 3, maxnreg=128)
    assert parse_tiles("32x4x3s2r128") == spec(32, 4, 3, maxnreg=128, num_splits=2)
    with pytest.raises(ValueError, match="expected KEYSxWARPSxSTAGES"):
        parse_tiles("32x4")
    with pytest.raises(ValueError, match="expected KEYSxWARPSxSTAGES"):
        parse_tiles("64x4x3he")        # the suffixes' order is fixed


def test_in_step_tiles_parse_into_decode_tiles(benchmarks_on_path):
    from decode_attention_in_step import forced_tiles
    from deepserve.kernels.decode_launch import DecodeTiles
    assert forced_tiles("64x4x3eh") == DecodeTiles(64, 4, 3, early_v=True, heads_first=True)
    assert forced_tiles("32x4x2") == DecodeTiles(32, 4, 2)
    assert forced_tiles("64x4x3ehp") == DecodeTiles(64, 4, 3, early_v=True, heads_first=True, kv_heads=2)


def test_start_decoding_holds_the_whole_batch_when_prefill_takes_many_steps(benchmarks_on_path, monkeypatch):
    """profile_gpu_step.start_decoding: with prompts that take more steps to prefill than the decode steps asked for
    (16 prompts of 48 tokens, 64 tokens a step: about 12 steps against 4), every sequence still decodes afterwards,
    and `max_tokens` more steps run the whole batch. Session 34's batch-256 profiles at 1k context were taken after
    the first sequences had finished."""
    import h200_dense
    import profile_gpu_step
    monkeypatch.setattr(profile_gpu_step, "DEVICE", "cpu")
    llm = profile_gpu_step.engine(h200_dense.write_config(h200_dense.SHAPES["tiny"]), device="cpu",
                                  max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64)
    eng = llm.engine
    ids = profile_gpu_step.start_decoding(eng, 16, 48, 4, "t", 1)
    seqs = [s for rid in ids for s in eng.requests[rid].seqs]
    for _ in range(4):
        eng.step()
        assert len(eng.scheduler.running) == 16 and not any(s.is_finished for s in seqs)
    eng.abort_request(ids)


def test_env_sweep_settings_and_combos(benchmarks_on_path):
    from ab_env_sweep import combos, settings
    assert settings(["A=1,2", "B=x"]) == [{"A": "1", "B": "x"}, {"A": "2", "B": "x"}]
    assert combos(["A=1,B=2", "A=3"]) == [{"A": "1", "B": "2"}, {"A": "3"}]
    with pytest.raises(SystemExit):
        combos(["A=1,B"])


def test_graph_timeline_arithmetic(benchmarks_on_path):
    """profile_gpu_step.idle_breakdown on two replays of three kernels: idle time between kernels, busy time as the
    union of intervals, every kernel name's launches and microseconds a replay, and what each adds to the span."""
    from profile_gpu_step import idle_breakdown
    one = [(0.0, 10.0, "gemv"), (12.0, 20.0, "attn"), (18.0, 30.0, "gemv")]     # a 2 us gap, then an overlap
    kernels = one + [(s + 100.0, e + 100.0, n) for s, e, n in one]
    r = idle_breakdown(kernels, reps=2)
    assert r["kernels_per_replay"] == 3 and r["busy_us"] == 28.0
    assert r["idle_us"] == (2.0 + 70.0 + 2.0) / 2                   # the gap between replays counts too
    assert r["by_kernel"] == [("gemv", 2.0, 22.0), ("attn", 1.0, 8.0)]
    assert [name for name, _ in r["sequence"]] == ["gemv", "attn", "gemv"]
    # What each launch adds to the span: the second gemv overlaps attn's last 2 us, so it adds 10 of its 12.
    assert r["sequence_exposed_us"] == [10.0, 8.0, 10.0]
    assert r["exposed_by_kernel"] == [("gemv", 20.0), ("attn", 8.0)]
    assert sum(us for _, us in r["exposed_by_kernel"]) + r["idle_us"] == r["span_us"]


def test_graph_timeline_exposed_time_under_pdl(benchmarks_on_path):
    """A kernel launched early (PDL) that waits for its predecessor: its duration counts the wait, its exposed time
    only what it runs past the predecessor's end; one that ends inside another adds nothing."""
    from profile_gpu_step import idle_breakdown
    one = [(0.0, 20.0, "swiglu"), (5.0, 30.0, "down"), (25.0, 28.0, "norm"), (29.0, 40.0, "qkv")]
    r = idle_breakdown(one, reps=1)
    assert r["sequence"] == [("swiglu", 20.0), ("down", 25.0), ("norm", 3.0), ("qkv", 11.0)]
    assert r["sequence_exposed_us"] == [20.0, 10.0, 0.0, 10.0]
    assert r["busy_us"] == r["span_us"] == 40.0 and r["idle_us"] == 0.0


def test_kernel_prices_of_a_1b_layer(benchmarks_on_path):
    """price_kernels_1b.py: a layer's launches found from the first qkv launch on, each role's median over the
    layers seen, its bytes (batch 2: the weights, and 2 sequences' KV at 1000 keys for the attention) and TB/s."""
    from price_kernels_1b import WEIGHT_BYTES, price
    layer = [("_rms_norm_kernel", 2.0), ("_skinny_kernel", 7.0), ("_rotary_write_kv_kernel", 2.0),
             ("_decode_kernel", 10.0), ("_skinny_kernel", 6.0), ("_rms_norm_kernel", 2.0),
             ("_skinny_kernel", 25.0), ("_skinny_kernel", 15.0)]
    slower = [(name, us * 3) for name, us in layer]
    sequence = [("_patch_tokens_kernel", 1.5), ("gather", 3.0)] + layer + slower + layer + layer[:3]
    entry = {"batch": 2, "context": 1000, "step_ms": 1.5,
             "graph_timeline": {"sequence": sequence, "span_us": 1500.0}}
    got = price(entry, bandwidth=3e12)
    assert got["layer_cycles_seen"] == 3
    assert [r["role"] for r in got["layer"]] == ["norm", "qkv", "rotary_kv", "attention", "o_proj", "norm",
                                                  "gate_up", "down"]
    assert [r["us"] for r in got["layer"]] == [us for _, us in layer]       # medians: the slow layer is out
    gate_up = got["layer"][6]
    assert gate_up["bytes"] == WEIGHT_BYTES["gate_up"] == 2 * 8192 * 2048 * 2
    assert gate_up["ideal_us"] == round(gate_up["bytes"] / 3e12 * 1e6, 2)
    assert got["layer"][3]["bytes"] == 2 * 1000 * 8 * 64 * 2 * 2
    assert got["layer_us"] == sum(us for _, us in layer)
    assert got["outside_layers_us"] == round(1500.0 - 16 * got["layer_us"], 1)
    assert "exposed_us" not in got["layer"][0]          # an older table: durations only
    entry["graph_timeline"]["sequence_exposed_us"] = [us / 2 for _, us in sequence]
    assert [r["exposed_us"] for r in price(entry, bandwidth=3e12)["layer"]] == [us / 2 for _, us in layer]
