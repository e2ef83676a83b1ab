"""How a paged decode launch is shaped, on the host: its tiles and pipeline (DecodeTiles), the KV heads one program
reads, how many splits of the context it gets, and whether and over what tile those splits merge in the decode
kernel (the counters it uses there). The kernels themselves and their launchers are kernels/paged_attention.py; each
rule here carries the measurements that set it.
"""

from dataclasses import dataclass, replace
from typing import Optional

import torch

from deepserve import envs
from deepserve.kernels import cdiv, next_pow2, num_sms


DECODE_BLOCK_N = 64


@dataclass(frozen=True)
class DecodeTiles:
    """Launch settings of the paged decode kernel: keys per tile, warps, pipeline stages, whether a tile's values
    load together with its keys (`early_v`) or after the scores, and the launch order (`heads_first`: the programs
    of one row's KV heads side by side, which read neighbouring pieces of the same cache rows at about the same
    time; else one KV head's rows side by side)."""
    block_n: int = DECODE_BLOCK_N
    num_warps: int = 4
    num_stages: int = 2
    early_v: bool = False
    heads_first: bool = False
    maxnreg: Optional[int] = None     # a register cap a thread (Triton's maxnreg; None: ptxas's choice)
    # Values stored transposed in each block ([KV heads, head_dim, slots]): an experiment's cache layout, which no
    # KV writer produces yet (benchmarks/fp8_attention_kernels.py times it on a transposed copy; lost with 16-slot
    # blocks, gqa_values_transposed_h200_s37.json; the gpu_pending stage values-t64 times it with 64-slot blocks).
    values_t: bool = False
    # KV heads a program reads side by side (2: `_decode_kernel`'s KV_HEADS, for heads of 128 bytes a token, whose
    # pieces of a token's row read at 81% of the copy bandwidth where Qwen3-MoE's 256-byte bf16 ones read at 93%:
    # H100, dense1b_attention_tiles_h100_s35.json, qwen3_attention_tiles_h100_s35.json). kv_heads_a_program picks it.
    kv_heads: int = 1


# A no-split launch whose programs fit on the SMs two at a time (in 128-wide heads): a third pipeline stage, the value
# tile loaded with the key tile. Three stages of key + value tiles (64 x 128 bf16 each) are 96 KB of shared memory,
# so two such programs fit an SM where the default's fit five (Nsight Compute: 39 KB a program, five an SM).
# Measured on an H200 in a step's surroundings
# (benchmarks/decode_attention_in_step.py, decode_attention_in_step_h200.json; us per layer, default -> these) at
# 256 programs: Llama-3-8B batch 32 47.0 -> 38.5 (1k context), 165.5 -> 125.0 (4k); Qwen3-MoE batch 64 47.1 -> 40.1;
# Llama-3.2-1B batch 64 (512 programs of 64-wide heads) 43.9 -> 38.2. At 512 programs of 128-wide heads they take
# two waves and lose (Llama-3-8B batch 64 69.4 -> 87.3, Qwen3-MoE batch 128 70.5 -> 88.9): the default stays there.
# Decode steps (session21_steps_ab_h200.json, ms): Llama-3-8B batch 32 9.29 -> 8.55 at 4k, 5.76 -> 5.63 at 1k;
# Llama-3.2-1B batch 64 3.85 -> 3.66 at 4k; Qwen3-MoE batch 64 6.11 -> 6.03.
DEEP_PIPELINE_TILES = DecodeTiles(num_stages=3, early_v=True)

# DEEPSERVE_GQA_DECODE_LAUNCH=heads-first (the default): the programs of one row's KV heads launch side by side. One
# token's heads lie side by side in the cache (a 128-wide E4M3 head is a 128-byte piece of Qwen3-MoE's 512-byte
# row), so programs launched together read whole rows at about the same time. Unsplit launches past the deep
# pipeline's range over an fp8 cache take three stages: an fp8 tile is half a bf16 one's bytes, and the device's
# two-stage build already holds only 4 programs an SM (110 registers, ncu_gqa_large_h100_s36.json). H100, one
# layer's call (gqa_heads_first_kernels_h100_s36.json): Qwen3-MoE batch 256 over E4M3 110.7 -> 104.9 us; its decode
# steps, three passes, 9.760 -> 9.737 ms (PDL hid most of the old launch's cost); Llama-3.2-1B batch 64 over bf16
# 2.219 -> 2.195 ms. docs/gpu.md has the rest (bf16 keeps two stages there; steps at other batches).
HEADS_FIRST = envs.DEEPSERVE_GQA_DECODE_LAUNCH == "heads-first"
# DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM (session 38's; timed in session 40): heads of at most PAIRED_HEAD_BYTES a token
# are read two KV heads a program (DecodeTiles.kv_heads), where the KV heads are even and lie side by side. "auto"
# (the default) pairs them over a 16-bit cache in a launch without a split whose programs fit the SMs in one wave
# (`fits_one_wave`, DEEP_PIPELINE_TILES' range): Llama-3.2-1B's 64-wide bf16 heads at batch 64, decode steps 2-5%
# faster on an H100 and an H200 (ms, one head / two, 1k and 4k: H100 2.184 / 4.631 -> 2.135 / 4.429,
# gqa_kv_pairs_ab_h100_s40.json; H200, two passes, 1.746-1.758 / 3.461-3.518 -> 1.713-1.715 / 3.293-3.313,
# gqa_pairs_auto_b256_ab_h200_s40.json). Past one wave the machines disagreed (batch 256: H100 4.765 / 13.811 ->
# 4.661 / 13.323; H200 3.756 / 9.874-9.987 -> 3.754-3.761 / 10.276-10.279), and split launches lost (batch 8: H100
# 1.316 / 1.626 -> 1.436 / 1.772, half the programs where there are too few already), as did 128-wide E4M3 heads
# at kernel level (Qwen3-MoE batch 256 104.7 -> 106.4-127.5 us by tiling, gqa_kv_pairs_kernels_h100_s40.json).
# "2": wherever they pair; "1": never.
KV_HEADS_PER_PROGRAM = envs.DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM
PAIRED_HEAD_BYTES = 128


# DEEPSERVE_DECODE_SPLIT_MERGE (session 42's): "last" merges a split launch's partials in the decode kernel itself,
# by the last split program of each (row, KV heads) to finish (`_decode_kernel`'s MERGE_LAST), instead of a reduce
# launch after it; over 2+ rows the next kernel starts as the decode's programs exit (LATE_TRIGGER). H100,
# Llama-3.2-1B steps, two passes each (split_merge_*_h100_s42.json): at 1k batch 1 1.076-1.090 -> 1.063-1.076 ms in
# four runs, batch 32 1.700-1.748 -> 1.629-1.647, batch 2 / 8 within 1.5% either way; at 4k batch 8 / 32 1.6% / 4%
# faster. Over 2-16 rows with the next kernel let in early it was 4-7% slower (batch 2 1.170 -> 1.251-1.257).
# The merge tile holds all of a program's heads, [heads, splits, head_dim] in float32, packed (the 1B's split build
# keeps its 64 registers at 16 splits: kernel_resources_split_merge_s42.json). Past MERGE_MAX_ELEMENTS the launch
# keeps its reduce, as it does where the reduce carries an L2 prefetch: tiles of 8192 were mixed (Llama-3-8B batch 8
# 0.6-1.3% slower in three pairs, Qwen3-MoE batch 32 0.9% faster in one).
SPLIT_MERGE = envs.DEEPSERVE_DECODE_SPLIT_MERGE
MERGE_MAX_ELEMENTS = 4096
# DEEPSERVE_DECODE_MERGE_ONE_TILE (session 45's, on by default): launches of one-tile partitions merge over tiles of
# up to twice MERGE_MAX_ELEMENTS (`decode_num_splits`). Llama-3.2-1B batch 1 at 1k (H100,
# kernel_table_splits_h100_s45.json): 17 one-tile splits made the decode launch 3.4 us faster than the rule's 9 of two
# tiles, but past the 16-split tile they took a reduce launch that cost as much. Merged in the kernel (80 registers
# instead of 64, no spills; such launches are a few rows' programs, where registers cost no occupancy) the batch-1
# steps were 2.7-2.9% faster in three pairs, 1.072-1.076 -> 1.042-1.045 ms, batch 2 0.5-4% faster in three, batch 4
# unchanged (merge_one_tile_1b_ab_h100_s45.json, mlp_prefetch_1b_ab*_h100_s45.json).
# Only heads of up to ONE_TILE_MAX_HEAD_DIM, the width it was timed at: Llama-3-8B's 128-wide heads would take 16
# one-tile splits at batch 1 and 1k where 8 of two tiles beat 16 with a reduce at kernel level (6.70 against 7.15 us,
# merge_splits_*_h100_s43.json), untimed merged.
ONE_TILE_MERGE = envs.DEEPSERVE_DECODE_MERGE_ONE_TILE
MERGE_MAX_ELEMENTS_ONE_TILE = 2 * MERGE_MAX_ELEMENTS
ONE_TILE_MAX_HEAD_DIM = 64
# The merge counters: one int32 per (row, KV-head program) of a split launch, zero between launches (the last
# program of each zeroes its own). Allocated once per device at SPLIT_COUNTERS slots, never reallocated: a CUDA
# graph keeps the pointer it captured. Launches on one device run one after another (one stream), so they share it.
SPLIT_COUNTERS = 1 << 16
_COUNTERS: dict = {}


def split_counters(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def merge_tile(num_heads: int, num_splits: int, head_dim: int, one_tile: bool = False) -> Optional[tuple[int, int]]:
    """(MERGE_G, MERGE_S) of a split launch's in-kernel merge for programs of `num_heads` query heads: its tile is
    [MERGE_G, MERGE_S, head_dim]. None where that is past MERGE_MAX_ELEMENTS (MERGE_MAX_ELEMENTS_ONE_TILE for a
    launch of one-tile partitions, `one_tile`, of heads up to ONE_TILE_MAX_HEAD_DIM under ONE_TILE_MERGE) or the
    head width is not a power of two (the partials are packed at it): the launch keeps its reduce."""
    tile = (next_pow2(num_heads), next_pow2(num_splits))
    cap = merge_elements(one_tile, head_dim)
    return tile if tile[0] * tile[1] * head_dim <= cap and head_dim == next_pow2(head_dim) else None


def merge_elements(one_tile: bool, head_dim: int) -> int:
    """The in-kernel merge tile's limit for a launch whose partitions are one tile (`one_tile`) or not:
    MERGE_MAX_ELEMENTS_ONE_TILE for one-tile partitions of heads up to ONE_TILE_MAX_HEAD_DIM under ONE_TILE_MERGE."""
    wider = ONE_TILE_MERGE and one_tile and head_dim <= ONE_TILE_MAX_HEAD_DIM
    return MERGE_MAX_ELEMENTS_ONE_TILE if wider else MERGE_MAX_ELEMENTS


def fits_one_wave(num_programs: int, head_dim: int, split: bool, device: torch.device) -> bool:
    """A launch without a split whose `num_programs` programs of `head_dim`-wide heads fit the SMs at two 128-wide
    programs each: DEEP_PIPELINE_TILES' range, and where "auto" pairs KV heads."""
    return not split and num_programs * head_dim <= 2 * num_sms(device) * 128


def kv_heads_a_program(head_dim: int, cache_elem_bytes: int, num_kv_heads: int, heads_adjacent: bool,
                       one_wave: bool, mode: str = "") -> int:
    """KV heads one decode program reads (DecodeTiles.kv_heads) under `mode` (default KV_HEADS_PER_PROGRAM): 2 only
    for heads of at most PAIRED_HEAD_BYTES a token, an even count, side by side in the cache's rows (`heads_adjacent`);
    "auto" also asks for a one-wave launch without a split (`one_wave`, `fits_one_wave`) over a 16-bit cache (the
    measured rule above)."""
    mode = mode or KV_HEADS_PER_PROGRAM
    can_pair = head_dim * cache_elem_bytes <= PAIRED_HEAD_BYTES and num_kv_heads % 2 == 0 and heads_adjacent
    if mode == "1" or not can_pair:
        return 1
    if mode == "auto" and (not one_wave or cache_elem_bytes != 2):
        return 1
    return 2


def decode_tiles(num_programs: int, head_dim: int, split: bool, device: torch.device,
                 fp8_cache: bool = False) -> DecodeTiles:
    """The decode kernel's launch setting for `num_programs` programs (rows x KV heads x splits) of `head_dim`-wide
    heads: DEEP_PIPELINE_TILES for a launch without a split that fits the SMs at two 128-wide programs each; past
    that, without a split, three stages over an fp8 cache (`fp8_cache`); else the default (split launches are sized
    for about four programs an SM). All with HEADS_FIRST's launch order."""
    if fits_one_wave(num_programs, head_dim, split, device):
        return replace(DEEP_PIPELINE_TILES, heads_first=HEADS_FIRST)
    if not split and fp8_cache and HEADS_FIRST:
        return DecodeTiles(num_stages=3, heads_first=True)
    return DecodeTiles(heads_first=HEADS_FIRST)


_MIN_PARTITION = 128     # keys per split at least
_FULL_WAVE = 1.9         # programs per SM (of 128-wide heads) that need no split: 250 on an H200's 132 SMs
# DEEPSERVE_DECODE_SPLIT_RULE: "merged" sizes the splits of a launch that merges in the kernel for that merge
# (decode_num_splits' `merge_heads` paragraph); "reduce" keeps session 42's counts, sized for a reduce launch.
SPLIT_RULE = envs.DEEPSERVE_DECODE_SPLIT_RULE
_MERGED_MIN_PARTITION = 64     # keys per split at least where the merge is in the kernel: one 64-key tile


def merge_max_splits(num_heads: int, head_dim: int, elements: int = MERGE_MAX_ELEMENTS) -> int:
    """The most splits an in-kernel merge over programs of `num_heads` query heads holds (`merge_tile`'s limit, a
    tile of `elements`): 0 where it holds none (a head width that is not a power of two)."""
    if head_dim != next_pow2(head_dim):
        return 0
    return elements // (next_pow2(num_heads) * head_dim)


def decode_num_splits(num_rows: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                      head_dim: int = 128, merge_heads: int = 0) -> int:
    """How many splits of the context a decode launch gets (one program per row, KV head and split).

    No split once (rows x KV heads) programs, counted in 128-wide heads (a 64-wide head's program moves half the
    bytes), reach about two per SM: there a split's reduce launch costs more than the parallelism gains (Qwen3-MoE
    at batch 64, 256 programs of 128-wide heads: 45 us without a split, 54 us with 2). Below that, enough splits
    for about four programs per SM, each of at least _MIN_PARTITION keys. Measured on an H200 for 64- and 128-wide
    heads, groups 4 and 8, batch 8 to 256, contexts 1k and 4k (benchmarks/tune_decode_attention.py,
    tune_decode_attention.json): within 12% of the best measured split count in 28 of 29 cases and 19% in the
    last (Llama-3-8B at batch 32 and 4k, where 2 splits win), against up to 38% for the rule before (1B, batch 8,
    4k context).

    `merge_heads` > 0: the launch merges its splits in the kernel, over programs of that many query heads (SPLIT_RULE
    "merged"; 0: a reduce launch). A split then costs its partial's write and one program's read of them, no
    launch, and on an H100 (merge_splits_*_h100_s43.json, every split count at kernel level):
    - partitions of one 64-key tile where that count fits the merge tile (Llama-3.2-1B batch 1 at 1k: 16 splits
      4.74 us against 8's 5.54);
    - the merge tile's count where the rule asks for at most half again as many, which would take the reduce
      (Qwen3-MoE batch 32 at 4k: 4 splits against 5's 56.5 / 94.0 against 62.5 / 101.9 us over E4M3 / bf16).
    Decode steps, two passes (split_rule_*_ab_h100_s43.json): Qwen3-MoE over E4M3 at batch 32 6.842-6.845 ->
    6.743-6.744 ms (4 splits, not 5). Past the one-wave line nothing splits still: 2 splits there were 7-12% faster
    at kernel level (batch 64 of Llama-3.2-1B / Qwen3-MoE, batch 32 of Llama-3-8B, 1k and 4k) but not in steps,
    with either PDL trigger (Llama-3.2-1B batch 64 at 1k 2.109-2.125 -> 2.151-2.162 ms, at 4k 0.4-1.2% slower;
    Llama-3-8B batch 32 at 4k 0.1-0.9% faster; split_rule_*_ab_h100_s43.json, split_wide_*_ab_h100_s43.json). The
    one-tile partitions did not show in those steps: their graphs are sized for ~1.1k keys, where 16 splits round
    to 9 of 128 keys (`decode_attention`). Since session 45 (ONE_TILE_MERGE) one-tile partitions up to twice the
    merge tile's count take it too, merged over a tile twice the size: such a graph's batch 1-2 launch of the 1B
    splits 18 ways (17 used), and its batch-1 steps were 2.7-2.9% faster (merge_one_tile_1b_ab_h100_s45.json).
    """
    programs = max(1, num_rows * num_kv_heads)
    sms = num_sms(device)
    wide = programs * head_dim / (sms * 128)            # 128-wide programs an SM
    most = merge_max_splits(merge_heads, head_dim) if merge_heads and SPLIT_RULE == "merged" else 0
    if wide >= _FULL_WAVE:
        return 1
    splits = max(1, min(cdiv(4 * sms, programs), cdiv(max_seq_len, _MIN_PARTITION), 64))
    if most:
        short = max(1, min(cdiv(4 * sms, programs), cdiv(max_seq_len, _MERGED_MIN_PARTITION), 64))
        if short <= most:
            return short
        # One-tile partitions past the tile, up to twice its count: merged over the larger tile (ONE_TILE_MERGE).
        one_tile = short == cdiv(max_seq_len, _MERGED_MIN_PARTITION)
        if short <= merge_max_splits(merge_heads, head_dim, merge_elements(one_tile, head_dim)):
            return short
        if splits <= most + most // 2:
            return most
    return splits


def launch_num_splits(num_rows: int, num_heads: int, kv_cache: torch.Tensor, max_seq_len: int,
                      merging: bool) -> int:
    """`decode_num_splits` for a launch of `num_rows` rows of `num_heads` query heads over `kv_cache` ([2, blocks,
    block size, KV heads, head_dim]) that merges its splits in the kernel if `merging` (DEEPSERVE_DECODE_SPLIT_MERGE
    "last" and no L2 prefetch at the reduce). The merge holds a split program's heads: its KV heads (pairs only
    where KV_HEADS_PER_PROGRAM pairs split launches) times the group."""
    hkv, d = kv_cache.shape[3], kv_cache.shape[4]
    pairs = kv_heads_a_program(d, kv_cache.element_size(), hkv, kv_cache.stride(3) == d, False)
    merge_heads = pairs * (num_heads // hkv) if merging else 0
    return decode_num_splits(num_rows, hkv, max_seq_len, kv_cache.device, d, merge_heads)


__all__ = ["DECODE_BLOCK_N", "DEEP_PIPELINE_TILES", "DecodeTiles", "HEADS_FIRST", "KV_HEADS_PER_PROGRAM",
           "MERGE_MAX_ELEMENTS", "MERGE_MAX_ELEMENTS_ONE_TILE", "ONE_TILE_MAX_HEAD_DIM", "ONE_TILE_MERGE",
           "PAIRED_HEAD_BYTES", "SPLIT_COUNTERS", "SPLIT_MERGE", "SPLIT_RULE", "decode_num_splits", "decode_tiles",
           "fits_one_wave", "kv_heads_a_program", "launch_num_splits", "merge_elements", "merge_max_splits",
           "merge_tile", "split_counters"]
