"""Kernel launch modes A/B'd through the decode sweep. AB picks one (default: the engine's settings):
  skinny_nopdl        the skinny GEMM launched without programmatic dependent launch (it waits for its predecessor
                      to finish, and its successor for it); every other kernel keeps PDL
  skinny_noprefetch   the skinny GEMM with PDL but no L2 prefetch of its first K step before the wait
  router_cublas       the MoE gate GEMM of 17-512 tokens on cuBLAS (a cast, the GEMM, a reduce; then the routing
                      kernel on [T, E] logits) instead of the split-K Triton kernel feeding the routing kernel
  moe_aligned_nopdl   the MoE aligned path's align, grouped gate/up and grouped down kernels launched without PDL
                      (as before session 20), every other kernel keeps it
  skinny_two_off      MLA's q and kv_a projections at 2-32 rows as two skinny launches, not one (skinny_linear_two)
  skinny_tiles_s19    the skinny GEMM's tiling rule before session 20: 32 rows x K steps of 512 for every weight of
                      4096+ rows and 4096+ long rows (Llama-3-8B's qkv, gate/up and LM head too, not 64 x 128)
  decode_tiles_s20    the paged decode kernel's launch setting before session 21: the default tiles for every launch
                      (no three-stage tiles for a no-split launch of one wave: decode_launch.decode_tiles)
  int64_decode_inputs the paged decode kernel on the step's int64 block tables, lengths and row indices, as before
                      session 21 (no int32 copies: layers/attention_triton.INT32_DECODE_INPUTS_MIN_ROWS)
  router_s21          the gate GEMM as before session 22: a float32 gate on the split-K kernel on CUDA cores at 17-64
                      tokens, cuBLAS above; a bf16 gate on cuBLAS from 17 tokens (no tensor-core variants:
                      moe_routing.router_tiles)
  shared_fusion_s21   the shared experts folded into the MoE grouped GEMMs up to 64 tokens, as before session 22
                      (layers/moe_triton.fused_shared_max_tokens)
  mla_decode_before   the MLA decode of an older kernels/mla_decode.py, whose path MLA_BEFORE names (git show
                      <rev>:deepserve/kernels/mla_decode.py > FILE), in place of this one
  align_s23           the MoE align of 129-4096 (token, expert) pairs in three launches (memset, count, place), as
                      before session 24, not one (kernels/moe_align.SINGLE_ALIGN_MAX_PAIRS)
  mla_inputs_apart    MLA's q and kv_a projections with a weight each, two GEMMs past 32 rows, as before session 24
                      (what DEEPSERVE_MLA_STACKED_INPUTS=0 does, switched here after import)
  absorb_mma_64       MLA's W_UK / W_UV products on the tensor-core Triton kernels up to 64 rows, not 16 (cuBLAS's bmm
                      above; mla_absorb_rows_ab_h200.json's runs, where the code's cap was 256 / 64 and a mode
                      absorb_mma_16 put it back to today's 16)
  shared_fusion_256   the shared experts folded into the MoE grouped GEMMs up to 256 tokens (not 128)
  skinny_s24          the skinny GEMM as before session 25: no split-K (every tiling's split_k 1), cuBLAS for narrow
                      weights of rows longer than 4096 (Llama-3.2-1B's down), 16 rows at most for narrow weights of
                      rows longer than 2048 (Qwen3-MoE's o_proj)
  logits_fp32         the CUDA graphs keep float32 logits, as before session 24 (a copy of the LM head's bf16
                      output made in the graph, then copied into the static buffer), not the head's own dtype
  align_one_hot       the MoE align of up to 128 pairs in the one-hot program (counts in registers), as before session
                      25, not the one-program align with atomics (moe_align.ONE_HOT_MAX_PAIRS)
  moe_no_pair         the MoE aligned path at every batch size (no pair mode: fused_moe.use_pair_mode false)
  logits_copy         the LM head's output copied into the graph's static logits, as before session 25, not written
                      there by the GEMM (layers/linear.linear's `out`)
  inflight_index_s25  overlapped scheduling's in-flight tokens patched as before session 26 in every step: an index
                      uploaded from pageable memory and two index kernels, not one device copy when the rows are the
                      previous step's in order (worker/launched_step.patch_inflight_tokens)
  ablate_rotary       a diagnostic, not a setting: the GQA attention's rotary + KV-cache write launch skipped (q left
                      unrotated, the cache unwritten: wrong tokens), to time what that launch costs inside a step
  ablate_routing      a diagnostic, not a setting: the MoE router (gate GEMM + routing kernel) replaced by fixed
                      uniform random ids (one draw per batch size, every layer the same), to time what routing costs
                      inside a step (the align and the experts' GEMMs run as before)
(The shared experts' fusion into the MoE grouped GEMMs has its own switch: DEEPSERVE_MOE_FUSED_SHARED=0. Session 24's
run of a since-removed mode, shared_blocks_s23, is in session24_steps_ab_h200.json.)
The switch (several, comma-separated, apply together) patches deepserve/kernels in this process, then runs
h200_decode_sweep.py with the remaining arguments.
A diagnostic: skinny_pdl_ab_h200.json holds the numbers. (moe_fused_combine_ab_h200.json came from a third mode,
the MoE pair mode's down GEMVs and combine in one launch, removed with its kernel after it lost.)

Run (GPU machine):
  for ab in default skinny_nopdl skinny_noprefetch; do for sh in qwen3-moe deepseek-v2-lite; do
    AB=$ab python benchmarks/ab_kernel_modes.py --shapes $sh --batches 8,16 --output /tmp/ab.json; done; done
"""

import os
import runpy
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import deepserve.kernels.fused_moe as fused_moe  # noqa: E402
import deepserve.kernels.moe_align as moe_align  # noqa: E402
import deepserve.kernels.moe_routing as moe_routing  # noqa: E402
import deepserve.kernels.paged_attention as paged_attention  # noqa: E402
import deepserve.kernels.skinny_gemm as skinny  # noqa: E402
import deepserve.layers.attention_triton as attention_triton  # noqa: E402
import deepserve.layers.moe_triton as moe_triton  # noqa: E402

for mode in os.environ.get("AB", "default").split(","):    # AB=a,b: both switches at once
    if mode == "skinny_nopdl":
        skinny.pdl_launch_args = lambda tensor: {"USE_PDL": False}
    elif mode == "skinny_noprefetch":
        _tiles = skinny.skinny_tiles
        skinny.skinny_tiles = lambda n, k: _tiles(n, k)._replace(prefetch=0)
    elif mode == "router_cublas":
        moe_routing.router_logit_partials_supported = lambda x, w: False
    elif mode == "moe_aligned_nopdl":
        fused_moe.aligned_launch_args = moe_align.aligned_launch_args = lambda tensor: {"USE_PDL": False}
    elif mode == "skinny_two_off":
        skinny.skinny_linear_two = lambda x, a, b: (skinny.skinny_linear(x, a), skinny.skinny_linear(x, b))
    elif mode == "skinny_tiles_s19":
        _tiles = skinny.skinny_tiles
        skinny.skinny_tiles = lambda n, k: (skinny.SkinnyTiles(32, 512, 4, 4) if n >= 4096 and k >= 4096
                                            else _tiles(n, k))
    elif mode == "decode_tiles_s20":
        paged_attention.decode_tiles = lambda num_programs, head_dim, split, device, fp8_cache=False: \
            paged_attention.DecodeTiles()
    elif mode == "int64_decode_inputs":
        attention_triton.INT32_DECODE_INPUTS_MIN_ROWS = 1 << 30
        _graph_metadata = attention_triton.TritonPagedAttention.build_graph_metadata

        def _int64_rows(self, batch, max_seq_len):
            meta = _graph_metadata(self, batch, max_seq_len)
            meta.decode_rows = meta.decode_seqs = meta.decode_rows.long()
            return meta
        attention_triton.TritonPagedAttention.build_graph_metadata = _int64_rows
    elif mode == "router_s21":
        moe_routing.router_tiles = lambda x, w: moe_routing.FMA_TILES if w.dtype == torch.float32 else None
    elif mode == "shared_fusion_s21":
        moe_triton.fused_shared_max_tokens = lambda gate_up: 64
    elif mode == "mla_decode_before":
        import deepserve.layers.mla_triton as mla_triton
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        from mla_decode_ab import load_before
        mla_triton.mla_decode = load_before(os.environ["MLA_BEFORE"]).mla_decode
    elif mode == "align_s23":
        moe_align.SINGLE_ALIGN_MAX_PAIRS = 0
    elif mode == "absorb_mma_64":
        import deepserve.kernels.mla_absorb as mla_absorb
        mla_absorb.MAX_MMA_BATCH = 64
    elif mode == "shared_fusion_256":
        moe_triton.fused_shared_max_tokens = lambda gate_up: 256
    elif mode == "mla_inputs_apart":
        moe_triton._STACK_MLA_INPUTS = False
    elif mode == "skinny_s24":
        _tiles, _applies = skinny.skinny_tiles, skinny.skinny_applies
        skinny.skinny_tiles = lambda n, k: (skinny.SkinnyTiles(16 if n <= 2048 else 64, 256, 4, 4)
                                            if n < 4096 and k >= 4096 else _tiles(n, k))
        skinny.skinny_max_rows = lambda n, k: 32 if k <= 2048 or n >= 4096 else 16
        skinny.skinny_applies = lambda x, w: _applies(x, w) and not (w.shape[0] < 4096 and w.shape[1] > 4096)
    elif mode == "align_one_hot":
        moe_align.ONE_HOT_MAX_PAIRS = 1 << 30
    elif mode == "moe_no_pair":
        fused_moe.use_pair_mode = lambda num_pairs, num_experts: False
    elif mode in ("logits_fp32", "logits_copy"):
        import deepserve.models.base as base
        import deepserve.models.deepseek_v41 as deepseek_v41

        def _head_then_copy(cls, to_float):
            head = cls.head_logits

            def head_logits(self, hidden, out=None):
                y = head(self, hidden)
                y = y.float() if to_float else y
                return y if out is None else out.copy_(y)
            cls.head_logits = head_logits
        for cls in (base.CausalLM, deepseek_v41.DeepseekV41ForCausalLM):
            _head_then_copy(cls, mode == "logits_fp32")
    elif mode == "ablate_rotary":
        import deepserve.layers.attention_triton as attention_triton
        attention_triton.rotary_write_kv = lambda kv_cache, q, *args, **kwargs: q
    elif mode == "ablate_routing":
        import deepserve.layers.moe as moe_layers
        _routes: dict = {}

        def _fixed_route(self, x, expert_load=None):
            key = (x.shape[0], x.device, self.weight.shape[0], self.cfg.top_k)
            if key not in _routes:     # made once, outside any capture: each capture's warm-up runs its size first
                assert not torch.cuda.is_current_stream_capturing(), f"ablate_routing: no fixed route for {key} yet"
                t, e, k = key[0], key[2], key[3]
                gen = torch.Generator().manual_seed(t)
                ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(x.device)
                _routes[key] = (torch.full((t, k), 1.0 / k, device=x.device), ids)
            return _routes[key]
        moe_layers.Router.forward = _fixed_route
    elif mode == "inflight_index_s25":
        import deepserve.worker.model_runner as model_runner

        def _patch_by_index(input_ids, rows, previous):
            if not rows:
                return
            index = torch.tensor([r for r, _ in rows] + [previous.row_of[s] for _, s in rows], dtype=torch.int64)
            index = index.to(input_ids.device, non_blocking=True)
            dst, src = index[:len(rows)], index[len(rows):]
            input_ids.index_copy_(0, dst, previous.device_tokens.index_select(0, src))
        model_runner.patch_inflight_tokens = _patch_by_index
    elif mode != "default":
        raise SystemExit(f"AB={mode!r}: default, skinny_nopdl, skinny_noprefetch, router_cublas, moe_aligned_nopdl, "
                         "skinny_two_off, skinny_tiles_s19, decode_tiles_s20, int64_decode_inputs, router_s21, "
                         "shared_fusion_s21, mla_decode_before, align_s23, mla_inputs_apart, logits_fp32, "
                         "absorb_mma_64, shared_fusion_256, skinny_s24, logits_copy, moe_no_pair, align_one_hot, "
                         "inflight_index_s25, ablate_rotary or ablate_routing")

sys.argv = [os.path.join(ROOT, "benchmarks", "h200_decode_sweep.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
