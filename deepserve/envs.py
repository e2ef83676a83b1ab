"""Every DEEPSERVE_* environment variable, declared once: its type, its default and what it means.

No other module reads `os.environ` for a DEEPSERVE_* name; it reads `envs.DEEPSERVE_X` (parsed on each
access, so a test may set the variable and see it) or `envs.get("DEEPSERVE_X")`. A few are read once, at
import, by kernels that bake them into compiled code; their help says so.

`python -m deepserve.envs` (or `deepserve env`) prints each variable with its current value. A DEEPSERVE_*
variable in the environment that is not declared here gets one warning naming the closest known one:
a typo would otherwise be silently ignored.

This module imports nothing of deepserve: every floor may read it.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

PREFIX = "DEEPSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


def _parse_str(name: str, raw: str) -> str:
    return raw


def _parse_path(name: str, raw: str) -> Path:
    return Path(raw).expanduser()


def _parse_list(name: str, raw: str) -> list[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "bool": _parse_bool, "int": _parse_int, "str": _parse_str, "path": _parse_path, "list": _parse_list,
}


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: str                         # bool | int | str | path | list (comma-separated)
    default: Any                      # the value when the variable is unset (or empty)
    help: str                         # one line: what it changes
    choices: tuple | None = None      # allowed values, when the set is closed
    secret: bool = False              # printed as *** by `deepserve env`

    def parse(self, raw: str | None) -> Any:
        if raw is None or raw == "":
            return self.default
        value = _PARSERS[self.kind](self.name, raw)
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.name}={raw!r}: expected one of {', '.join(map(str, self.choices))}")
        return value

    def value(self) -> Any:
        return self.parse(os.environ.get(self.name))

    def is_set(self) -> bool:
        return os.environ.get(self.name, "") != ""


_DECLARED = [
    EnvVar("DEEPSERVE_CACHE_DIR", "path", Path.home() / ".cache" / "deepserve" / "kernels",
           "where the CPU C kernels are compiled to and cached"),
    EnvVar("DEEPSERVE_CPU_KERNELS", "bool", True,
           "use the CPU C kernels (decode attention, rotary, argmax, token bitmask, int8 quantizer); 0: the PyTorch "
           "paths"),
    EnvVar("DEEPSERVE_CPU_FEW_ROW_LINEAR", "int", 32,
           "float32 CPU linears of at most this many rows (decode steps, short prompts) run the C kernel of "
           "kernels/cpu/invariant_linear.c, which streams the weight faster than F.linear's BLAS there; 0: always "
           "F.linear (read at import)"),
    EnvVar("DEEPSERVE_CPU_FUSED_DECODE", "bool", True,
           "CPU decode steps of few rows through a GGUF-packed or float32 Llama stack: every layer in one C call "
           "(kernels/cpu/llama_decode.c); 0: layer by layer through the modules (read when the model is built)"),
    EnvVar("DEEPSERVE_MIXED_CUDA_GRAPHS", "bool", True,
           "replay steps with prompt work (prompt chunks beside decodes, up to 2,048 tokens) from CUDA graphs too, "
           "per token bucket (worker/mixed_graph.py); 0: such steps run eagerly (read at start-up)"),
    EnvVar("DEEPSERVE_GRAPH_TOKENS", "bool", True,
           "decode CUDA graphs end with the greedy argmax into a token buffer they keep, and start by patching "
           "the in-flight tokens the previous replay left there: a greedy decode step without logprobs then runs "
           "neither the argmax nor the token patch between two replays (worker/cuda_graph.py). On since session 41: "
           "Llama-3.2-1B steps at batch 1 / 8 / 64 0.3 / 1.6 / 1.0% faster on an H100 "
           "(graph_tokens_1b_*_h100_s41.json); Qwen3-MoE batch 8 / 128 moved under 0.5% on an H200 "
           "(graph_inputs_ab_h200.json) (read at start-up)"),
    EnvVar("DEEPSERVE_COMPACT_BLOCK_TABLES", "str", "auto",
           "CUDA graphs (decode and mixed steps): 1: a step's block tables travel to the GPU packed at its longest "
           "table's width and the graph spreads them to max_model_len's width (kernels/graph_inputs.py), 0: at "
           "max_model_len's width (16 MB a step at batch 256 and a 128k context); auto (the default): packed where "
           "max_model_len's row holds 512 blocks or more (worker/cuda_graph.py COMPACT_MIN_BLOCKS; H100, "
           "Llama-3.2-1B batch 64 at 1k from an engine sized for 128k 3.4% faster, for 1.1k 0.5% slower) "
           "(read at start-up)", choices=("auto", "1", "0")),
    EnvVar("DEEPSERVE_MAPPED_STEP_IO", "bool", True,
           "decode CUDA graphs with carried tokens (DEEPSERVE_GRAPH_TOKENS) read the step's inputs from pinned host "
           "memory in their first launch and write the greedy tokens into pinned host memory in their argmax: no "
           "copies queued between two replays (kernels/graph_inputs.py; two graphs a batch size, one per host "
           "buffer). On since session 47: Llama-3.2-1B steps at 1k, batch 1 1.037 -> 1.024-1.025 ms on an H100 "
           "(mapped_io_1b_ab_h100_s47.json); 0: the copies (read at start-up)"),
    EnvVar("DEEPSERVE_CPU_ISA", "str", "auto",
           "CPU kernel choice: act as if this CPU had only this feature set (never more than it has); "
           "auto: detect", choices=("auto", "avx2", "avx_vnni", "avx512", "avx512_vnni", "amx")),
    EnvVar("DEEPSERVE_YOCO_PREFILL_TRUNCATION_MODE", "str", "off",
           "DeepSeek-V4.1 YOCO bounded suffix replay in prefill: off; mask (consumer-half sliding window narrowed "
           "to the last KEEP tokens); compact (consumer layers compute only those rows)",
           choices=("off", "mask", "compact")),
    EnvVar("DEEPSERVE_YOCO_PREFILL_KEEP_TOKENS", "int", 0,
           "YOCO: the suffix of each prompt the consumer half computes; >= window + tokens per decode step when "
           "the mode is not off"),
    EnvVar("DEEPSERVE_BATCH_INVARIANT", "bool", False,
           "batch-invariant mode (CPU): a request's logits are bitwise the same whatever it is batched with; the "
           "default of EngineArgs.batch_invariant"),
    EnvVar("DEEPSERVE_FUSED_NORMS", "bool", True,
           "GPU batch-1 decode: RMSNorm in GEMV prologues, residual adds in GEMV epilogues (read at import)"),
    EnvVar("DEEPSERVE_SKINNY_GEMM", "bool", True,
           "GPU decode GEMMs of 2-32 rows (2-16 for narrow weights of rows 2049-4095 long) through the skinny "
           "Triton GEMM (kernels/skinny_gemm.py), the SwiGLU in the gate/up one's epilogue; 0: cuBLAS and the "
           "SiLU-and-mul kernel (read at import)"),
    EnvVar("DEEPSERVE_SKINNY_64_ROWS", "bool", True,
           "GPU decode GEMMs of 33-64 rows through the skinny Triton GEMM where it beat cuBLAS alone on an H100 "
           "(SwiGLU gate/up weights of rows up to 2048 long, split-K weights; kernels/skinny_gemm.py "
           "skinny_wide_tiles; Llama-3.2-1B batch 64 at 1k 2.30 -> 2.24 ms, skinny_64_rows_ab_h100_s35.json); "
           "0: cuBLAS (read at import)"),
    EnvVar("DEEPSERVE_MLA_ABSORB_MMA", "bool", True,
           "GPU MLA decode of 3-16 rows: the W_UK / W_UV products on the tensor-core Triton kernels "
           "(kernels/mla_absorb.py); 0: cuBLAS's bmm, as at more rows (read at import)"),
    EnvVar("DEEPSERVE_MLA_STACKED_INPUTS", "bool", True,
           "GPU multi-head latent attention: the q (or q_a) and kv_a projections' weights in one tensor, one GEMM "
           "for both past the fused launches' 32 rows; 0: two weights, two GEMMs (read at import)"),
    EnvVar("DEEPSERVE_MLA_DECODE_TILES", "str", "",
           "GPU MLA decode: every launch with these tiles, 'KEYSxWARPSxSTAGES[rREGISTERS]' (e.g. 16x4x3, or "
           "32x4x2r168 with a register cap), an A/B switch for decode steps (benchmarks/ab_env_sweep.py; "
           "kernel_resources.py prices each); unset: 32x4x3 (kernels/mla_decode.py, read at import)"),
    EnvVar("DEEPSERVE_MLA_PROGRAMS_PER_SM", "int", 2,
           "GPU MLA decode: the context is split until (sequences x head tiles x splits) reaches this many programs "
           "an SM (kernels/mla_decode.py mla_num_splits; 2 measured best on an H200 with the unchunked kernel), an "
           "A/B switch with DEEPSERVE_MLA_DECODE_TILES' register cap (read at import)"),
    EnvVar("DEEPSERVE_MLA_WGMMA", "bool", True,
           "GPU MLA decode over an 8-bit cache on sm_90 with f16 products (DEEPSERVE_FP8_PRODUCTS): the Gluon kernel "
           "with tokens as the products' rows on warpgroup MMAs (kernels/mla_decode_wgmma.py; H100, V2-Lite batch "
           "256: kernel 101.9 -> 90.5 us, step 15.03 -> 14.61 ms, mla_wgmma_prefetch_*_h100_s54.json); 0: "
           "kernels/mla_decode.py's Triton kernel (read at each launch)"),
    EnvVar("DEEPSERVE_MLA_WGMMA_ASYNC", "bool", True,
           "GPU MLA decode on warpgroup MMAs (DEEPSERVE_MLA_WGMMA): the next key tile's chunks 3-7 travel by cp.async "
           "into shared memory while a tile computes, and the block table is read a tile ahead (kernels/"
           "mla_decode_wgmma.py; H100, V2-Lite batch 256: kernel 91.0 -> 77.3 us, steps 14.61 -> 14.31 (cp.async) "
           "and 14.34 -> 14.21 ms (the table ahead) in two runs, mla_wgmma_{async,table_ahead}_*_h100_s55.json); "
           "0: the next tile's chunks 3-8 load into registers at its start, session 54's kernel (read at each "
           "launch)"),
    EnvVar("DEEPSERVE_MLA_WGMMA_REG_SCORES", "bool", True,
           "GPU MLA decode on warpgroup MMAs (DEEPSERVE_MLA_WGMMA): the score products take the widened keys from "
           "registers, as each chunk is widened, instead of reading them back from shared memory (a tile's shared-"
           "memory traffic ~246 -> ~166 KB; kernels/mla_decode_wgmma.py; H100, V2-Lite batch 256: kernel 78.3 -> "
           "75.6 us, steps 14.53 / 14.51 -> 14.45 / 14.45 ms in two passes, mla_reg_scores_*_h100_s57.json); 0: "
           "session 55's kernel (read at each launch)"),
    EnvVar("DEEPSERVE_ROUTER_SPLITS", "int", 0,
           "GPU MoE router GEMM on the split-K kernel (17-512 tokens on tensor cores): its hidden dim in this many "
           "parts, rounded up to a power of two (at most 16 and the K steps), instead of the rule of two programs an "
           "SM (kernels/moe_routing.py router_splits; 16 at 256 tokens of V2-Lite's gate); an A/B switch (read at "
           "import)"),
    EnvVar("DEEPSERVE_MOE_ALIGN_GATHER", "bool", True,
           "GPU MoE align of a decode batch (one program): a pair's run start by tl.gather and the blocks labelled by "
           "stores, no round trips through its scratch (kernels/moe_align.py; H100: 7.3 -> 4.8 us at Qwen3-MoE's 256 "
           "tokens); 0: the scratch round trip and a binary search of 8 dependent loads, for A/Bs (read at import)"),
    EnvVar("DEEPSERVE_MOE_FUSED_SHARED", "bool", True,
           "GPU MoE layers in the aligned (grouped GEMM) mode, up to 128 tokens (64 where the shared gate/up weight "
           "passes 32 MB), run the shared experts as extra blocks of the routed experts' GEMMs, where "
           "DEEPSERVE_MOE_SHARED_STREAM=0 keeps them off the side stream; 0: their own launches, before the routed "
           "experts"),
    EnvVar("DEEPSERVE_MOE_SHARED_STREAM", "bool", True,
           "GPU MoE layers launch their shared experts on a second CUDA stream, beside the router and the routed "
           "experts (layers/side_stream.py: a fork and a join, edges inside a CUDA graph), never as blocks of the "
           "grouped GEMMs; 0: in order on one stream (fused up to DEEPSERVE_MOE_FUSED_SHARED's tokens)"),
    EnvVar("DEEPSERVE_MOE_DOWN_TILES", "str", "",
           "GPU MoE layers in the aligned (grouped GEMM) mode at decode sizes (up to 256 rows an expert): the down "
           "GEMM's tiles, `NxKxWARPSxSTAGES` (output columns, K step, warps, pipeline stages), over "
           "kernels/fused_moe.py's pick (a tuning switch); empty: the pick (read at import)"),
    EnvVar("DEEPSERVE_MOE_COMBINE_IN_NORM", "bool", False,
           "GPU MoE layers (one process) hand their output on uncombined: the next layer's add + RMSNorm (or the "
           "final norm) sums each token's expert rows as it loads them (kernels/norm.py combine_add_rms_norm), one "
           "launch a layer fewer, bit for bit the same; an A/B switch until a GPU run times it (read at model build)"),
    EnvVar("DEEPSERVE_PDL", "bool", True,
           "programmatic dependent launch for the decode-path Triton kernels on Hopper and later"),
    EnvVar("DEEPSERVE_GEMV_PREFETCH", "int", 1,
           "what a GEMV does before its PDL wait: 0 nothing, 1 L2 prefetch of its first K step, 2 of all its "
           "rows, 3 first K step into registers (read at import)", choices=(0, 1, 2, 3)),
    EnvVar("DEEPSERVE_GEMV_TILING", "str", "",
           "the batch-1 GEMV's tiling per class of shape, over kernels/gemv.py's table (a tuning switch for a new "
           "GPU): `class=ROWSxBLOCK_KxWARPS` entries joined by `;`, the classes many_rows (N >= 8192), long_rows "
           "(K > 2048) and short_rows; empty or `default`: the table (read at import)"),
    EnvVar("DEEPSERVE_L2_PREFETCH", "str", "off",
           "GPU decode steps of up to 64 rows: extra programs of an attention kernel ask L2 for the o_proj weight "
           "while the attention runs (kernels/l2_prefetch.py; Hopper and later): off (the default until an H200 "
           "A/B says otherwise); rotary: the GQA rotary + KV-write kernel's programs; reduce: the split decode's "
           "reduce kernel's (batch 1 too); a _evict_last suffix tags the lines evict-last (read at first use)",
           choices=("off", "rotary", "rotary_evict_last", "reduce", "reduce_evict_last")),
    EnvVar("DEEPSERVE_FP8_WIDEN", "str", "values",
           "GPU attention over an fp8 KV cache: where a tile's 8-bit codes widen to bf16 (kernels/kv_rounding.py): "
           "late (wherever Triton puts it), values (value tiles in registers, before shared memory), all (key "
           "tiles too) (read at import)", choices=("late", "values", "all")),
    EnvVar("DEEPSERVE_FP8_PRODUCTS", "str", "f16",
           "GPU decode attention over an fp8 KV cache with bf16 activations: the products run in f16 (one widening "
           "instruction per pair of E4M3 codes; kernels/kv_rounding.py; H200: Llama-3-8B batch 64 at 4k 12.71 -> "
           "10.60 ms a step, fp8_products_ab_h200.json), or in the activations' dtype (read at import)",
           choices=("activations", "f16")),
    EnvVar("DEEPSERVE_GQA_DECODE_LAUNCH", "str", "heads-first",
           "GPU paged decode kernel's launch rule: a row's KV heads side by side, and unsplit launches past the deep "
           "pipeline's range over an fp8 cache at three stages (H100, one layer's call: Qwen3-MoE batch 256 over "
           "E4M3 110.7 -> 104.9 us, gqa_heads_first_kernels_h100_s36.json), or session 35's rule: one KV head's "
           "rows side by side, two stages there (read at import)",
           choices=("heads-first", "rows-first")),
    EnvVar("DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM", "str", "auto",
           "GPU paged decode attention: KV heads of at most 128 bytes a token read two adjacent ones a program "
           "(kernels/decode_launch.py kv_heads_a_program: 256-byte pieces of a token's row instead of 128), where "
           "the KV heads are even; auto (the default): in one-wave launches without a split over a 16-bit cache "
           "(Llama-3.2-1B batch 64 steps 2-5% faster on an H100 and an H200; batch 8's split launches 9% slower, "
           "batch 256 mixed), 2: wherever they pair, 1: never (read at import)", choices=("auto", "1", "2")),
    EnvVar("DEEPSERVE_DECODE_SPLIT_MERGE", "str", "last",
           "GPU paged decode attention split over the context: last (the default): the last split program of each "
           "(row, KV head) to finish merges the splits in the decode kernel (a counter each, "
           "kernels/paged_attention.py; H100, Llama-3.2-1B steps at 1k: batch 1 1-1.5% and batch 32 4% faster, "
           "batch 2-16 within 2%); reduce: a reduce launch after it (read at import)", choices=("reduce", "last")),
    EnvVar("DEEPSERVE_DECODE_SPLITS", "int", 0,
           "GPU paged decode attention: every engine launch split over the context in this many parts (0: the rule, "
           "kernels/decode_launch.py decode_num_splits); an A/B switch for kernel tables (past the in-kernel merge's "
           "tile a launch merges with a reduce; batch-invariant mode never splits) (read when an engine starts)"),
    EnvVar("DEEPSERVE_DECODE_SPLIT_RULE", "str", "merged",
           "GPU paged decode attention's split counts: merged (the default): sized for the in-kernel merge where a "
           "launch merges there (one-tile partitions where the merge holds them, the merge tile's split count where "
           "the rule asks for a few more: kernels/decode_launch.py decode_num_splits; H100, Qwen3-MoE over E4M3 "
           "batch 32 steps 1.5% faster); reduce: session 42's counts, sized for a reduce launch (read at import)",
           choices=("merged", "reduce")),
    EnvVar("DEEPSERVE_DECODE_MERGE_ONE_TILE", "bool", True,
           "GPU paged decode attention: where one-tile (64-key) partitions need more splits than the in-kernel "
           "merge's tile holds but at most twice as many, split that way and merge them in the kernel over a tile "
           "twice the size (Llama-3.2-1B batch 1-2 near 1k: 18 splits, 17 used, instead of 9 of two tiles; H100 "
           "batch-1 steps 2.7-2.9% faster, merge_one_tile_1b_ab_h100_s45.json); 0: those launches keep the merge "
           "tile's count (kernels/decode_launch.py, read at import)"),
    EnvVar("DEEPSERVE_EARLY_INPUTS", "bool", True,
           "decode / reduce / rotary-write kernels read the step's inputs before the PDL wait (read at import)"),
    EnvVar("DEEPSERVE_GC_FREEZE", "bool", True,
           "once an engine has started, freeze the objects alive (gc.freeze) so that full garbage collections, "
           "which otherwise walk them all (90 ms for the default model on 2 cores), skip them "
           "(engine/startup_heap.py)"),
    EnvVar("DEEPSERVE_SO_COMPILE_TIMEOUT", "int", 20,
           "structured outputs: seconds a request may wait for its grammar to compile before it fails "
           "(FINISHED_SO_FAILED)"),
    EnvVar("DEEPSERVE_SO_COMPILE_THREADS", "int", 2,
           "structured outputs: threads compiling grammars off the engine's thread"),
    EnvVar("DEEPSERVE_SO_CACHE_SIZE", "int", 256,
           "structured outputs: compiled grammars kept (LRU over distinct schemas)"),
    EnvVar("DEEPSERVE_ENGINE_IN_PROCESS", "bool", None,
           "`deepserve serve`: 1 steps the engine on a thread of the HTTP server's process (as "
           "--engine-in-process), 0 in an engine process of its own; unset: the process on a GPU, the thread on "
           "the CPU"),
    EnvVar("DEEPSERVE_API_KEY", "list", [],
           "API keys `deepserve serve` accepts (comma-separated); safer than --api-key, which `ps` shows",
           secret=True),
]
VARIABLES: dict[str, EnvVar] = {v.name: v for v in _DECLARED}


def get(name: str) -> Any:
    """The current value of a declared variable (its default when unset)."""
    try:
        var = VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared deepserve environment variable (see deepserve/envs.py)") from None
    return var.value()


def __getattr__(name: str) -> Any:
    # `envs.DEEPSERVE_PDL` reads the environment now, not at import.
    if name in VARIABLES:
        return VARIABLES[name].value()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def unknown_variables(environ: dict[str, str] | None = None) -> list[tuple[str, str | None]]:
    """(name, closest declared name or None) for each DEEPSERVE_* name in `environ` that is not declared."""
    environ = os.environ if environ is None else environ
    found = []
    for name in sorted(environ):
        if name.startswith(PREFIX) and name not in VARIABLES:
            # Compared without the shared prefix, which would make every name look alike.
            suffixes = [known[len(PREFIX):] for known in VARIABLES]
            close = difflib.get_close_matches(name[len(PREFIX):], suffixes, n=1, cutoff=0.6)
            found.append((name, PREFIX + close[0] if close else None))
    return found


_warned: set[str] = set()


def warn_unknown_variables(environ: dict[str, str] | None = None) -> list[str]:
    """Log one warning per unknown DEEPSERVE_* variable (once per process); returns the messages logged."""
    messages = []
    for name, close in unknown_variables(environ):
        if name in _warned:
            continue
        _warned.add(name)
        hint = f"; did you mean {close}?" if close else ""
        message = f"unknown environment variable {name} is ignored{hint} (`deepserve env` lists the known ones)"
        logger.warning(message)
        messages.append(message)
    return messages


def describe() -> str:
    """One block per variable: name, current value (or the error its value raises), default and meaning."""
    lines = []
    for var in _DECLARED:
        try:
            current = var.value()
        except ValueError as e:
            current = f"<invalid: {e}>"
        if var.secret and var.is_set():
            current = "***"
        source = "set" if var.is_set() else "default"
        lines.append(f"{var.name}={current}  ({source}; {var.kind}, default {var.default})")
        lines.append(f"    {var.help}")
    for name, close in unknown_variables():
        lines.append(f"{name}  (unknown: ignored" + (f"; did you mean {close}?)" if close else ")"))
    return "\n".join(lines)


def main() -> None:
    print(describe())


if __name__ == "__main__":
    main()
