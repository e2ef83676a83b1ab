"""Engine arguments (what a user sets) and the engine configuration derived from them.

`EngineArgs` is the flat, user-facing bag of options (also the `LLM(...)` keywords and CLI flags).
`EngineArgs.create_engine_config()` resolves defaults against the model and the device and returns an
`EngineConfig` made of small per-concept configs that the engine's stages read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

# torch is imported where a dtype or device is built, not here: `deepserve --help` reads EngineArgs' fields and
# should not pay for importing torch.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# KV caches may also hold 8-bit floats (vLLM's names; "fp8" is E4M3): half a bf16 cache's bytes, rounded to nearest
# and saturated at the format's largest finite value, with no scale (vLLM's default for checkpoints without
# calibrated k/v scales).
FP8_KV_NAMES = ("fp8", "fp8_e4m3", "fp8_e5m2")
# quantization=: int8 weights; int8 weights and activations; a GGUF file's blocks kept packed (fp32 activations; int8
# activations, llama.cpp's numerics).
QUANTIZATIONS = ("int8", "w8a8", "gguf", "gguf_a8")
GGUF_QUANTIZATIONS = ("gguf", "gguf_a8")


def torch_dtype(name: str) -> "torch.dtype":
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[name]


def is_fp8(dtype: "torch.dtype") -> bool:
    """An 8-bit float KV cache dtype."""
    from deepserve.kernels.reference.attention import FP8_DTYPES
    return dtype in FP8_DTYPES

# CPU default of SchedulerConfig.max_prefill_tokens_while_decoding. A CPU step's time grows with its token count
# (2-core Xeon, default model: 16 decodes ~63 ms, + ~0.7 ms a prefill token; benchmarks/cpu_serve_itl.json), so
# 128 prefill tokens keep a step with decodes within ~2.4x a decode-only step, where 2048 made it ~25x. GPU
# defaults are left as they were (not measured there).
CPU_MAX_PREFILL_TOKENS_WHILE_DECODING = 128


@dataclass
class ModelConfig:
    model: str                      # path of an HF checkpoint directory or a .gguf file
    hf_config: dict[str, Any]       # the model's config.json (or its GGUF equivalent)
    dtype: torch.dtype
    max_model_len: int
    load_format: str                # "auto" | "dummy"
    skip_tokenizer_init: bool
    seed: int
    # None | "int8" (weight-only) | "w8a8" (see layers/quantization.py) | "gguf" (a GGUF file's Q4_1 / Q8_0 blocks
    # kept packed, CPU only: layers/gguf_linear.py) | "gguf_a8" (the same with int8 activations, llama.cpp's numerics)
    quantization: str | None = None
    keep_mtp: bool = False          # build and load DeepSeek-V3's MTP layer (speculative_config method "mtp")
    dspark: bool = False            # run DeepSeek-V4.1's DSpark draft blocks (speculative_config method "dspark")
    # Every row's logits independent of the batch, chunking and cache hits (layers/batch_invariant.py).
    batch_invariant: bool = False

    @property
    def architecture(self) -> str:
        return self.hf_config.get("architectures", ["LlamaForCausalLM"])[0]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def is_gguf(self) -> bool:
        return self.model.endswith(".gguf")


@dataclass
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float
    num_blocks: int | None = None   # filled in by the model runner once the budget is known
    # The window pool (engine/block_manager.py), also filled in by the runner: 0 blocks for models without one.
    num_window_blocks: int = 0
    window_reach: int = 0
    dtype: torch.dtype | None = None   # of the KV cache; None: the model's dtype


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    async_scheduling: bool = False      # overlap: schedule step n+1 while step n runs on the device
    # Prefill tokens (prompt chunks) a step may carry while some sequence decodes; None: no cap beyond
    # max_num_batched_tokens. Every decode waits for its whole step, so this bounds inter-token latency.
    max_prefill_tokens_while_decoding: int | None = None
    # Fraction of blocks kept free when admitting new prompts, so that a request resumed after
    # preemption is not preempted again at once by the next admission (vLLM uses 1%).
    watermark: float = 0.01


@dataclass
class DeviceConfig:
    device: torch.device
    enforce_eager: bool = False                 # no CUDA graphs
    cuda_graph_max_batch_size: int | None = None   # largest captured decode batch (None: max_num_seqs, <= 512)


@dataclass
class ParallelConfig:
    """Ranks of one engine (deepserve/parallel/groups.py has the layout): world = data_parallel x tensor_parallel.

    - tensor_parallel_size: ranks sharing one replica's attention heads and dense / expert weights;
    - data_parallel_size: replicas, each an engine of its own (scheduler, KV cache, requests); with more than one,
      steps are prompt-only or decode-only, chosen by the ALL/ANY votes (deepinfer.md section 4.2);
    - expert_parallel_size: ranks over which each MoE layer's experts are spread (a multiple of tp);
    - eplb_interval: steps between expert rebalancings (0: never), over the last `eplb_window` steps' counts;
      num_redundant_experts: extra physical expert slots (replicas), padded up to a multiple of the EP size."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    eplb_interval: int = 0
    eplb_window: int = 100
    num_redundant_experts: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    def num_physical_experts(self, num_experts: int) -> int:
        """E + the redundant slots, padded so that every EP rank holds as many."""
        ep = self.expert_parallel_size
        return -(-(num_experts + self.num_redundant_experts) // ep) * ep


def check_parallel_sizes(world: int, tp: int, ep: int) -> None:
    """A clear error for sizes that make no layout (deepserve/parallel/groups.py)."""
    for name, value in (("tensor_parallel_size", tp), ("expert_parallel_size", ep)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if world % tp:
        raise ValueError(f"the world of {world} ranks does not split into tensor-parallel groups of {tp}")
    if ep > world or world % ep:
        raise ValueError(f"expert_parallel_size {ep} must divide the number of ranks ({world} = "
                         f"data_parallel_size x tensor_parallel_size)")
    if ep > 1 and ep % tp:
        raise ValueError(f"expert_parallel_size {ep} must be a multiple of tensor_parallel_size {tp} "
                         "(an expert-parallel group holds whole tensor-parallel groups)")


def json_dict(value: Any, name: str, example: str) -> dict[str, Any]:
    """A dict-valued engine argument given as a dict or as its JSON text (the CLI's form); ValueError naming it."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict like {example}; got {type(value).__name__}")  # noqa: TRY004
    return value


SPEC_METHODS = ("ngram", "mtp", "dspark")
VERIFY_LENGTHS = ("fixed", "confidence")


@dataclass
class SpeculativeConfig:
    """What `speculative_config={...}` asks for (vLLM's name, DeepInfer's verification-length scheduler).

    method: where drafts come from ("ngram": prompt lookup, any model; "mtp": DeepSeek-V3's next-token layers;
    "dspark": DeepSeek-V4.1's draft blocks). num_speculative_tokens: drafts proposed per sequence and step (k).
    verify_length: "fixed" verifies all k; "confidence" verifies the number that maximises expected accepted tokens
    per unit of step time (spec_decode/length_policy.py). prompt_lookup_min/max: n-gram sizes tried, longest first.
    cost_curve: [[rows, ms], ...] of a step's forward time by query rows (measured at start-up when absent).
    gate (verify_length "confidence", method "ngram"): measure the engine's output tokens/s with speculation on and off, in
    alternating phases, and speculate only while it is the faster (spec_decode/gate.py); false: always speculate."""
    method: str
    num_speculative_tokens: int
    verify_length: str = "fixed"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    cost_curve: list[tuple[int, float]] | None = None
    gate: bool = True

    @classmethod
    def from_dict(cls, spec: dict[str, Any] | None) -> "SpeculativeConfig | None":
        if spec is None:
            return None
        spec = json_dict(spec, "speculative_config", "{'method': 'ngram', 'num_speculative_tokens': 4}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        for key in ("method", "num_speculative_tokens"):
            if key not in spec:
                raise ValueError(f"speculative_config needs {key!r}")
        config = cls(**spec)
        config.validate()
        return config

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"speculative_config: {msg}")
        need(self.method in SPEC_METHODS, f"method must be one of {', '.join(SPEC_METHODS)}; got {self.method!r}")
        k = self.num_speculative_tokens
        need(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 32,
             f"num_speculative_tokens must be an integer in [1, 32]; got {k!r}")
        need(self.verify_length in VERIFY_LENGTHS,
             f"verify_length must be one of {', '.join(VERIFY_LENGTHS)}; got {self.verify_length!r}")
        need(isinstance(self.gate, bool), f"gate must be true or false; got {self.gate!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        need(isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi,
             f"prompt_lookup_min/max must be integers with 1 <= min <= max; got {lo!r}, {hi!r}")
        if self.cost_curve is not None:
            try:
                curve = [(int(g), float(ms)) for g, ms in self.cost_curve]
            except (TypeError, ValueError):
                raise ValueError("speculative_config: cost_curve must be [[rows, ms], ...]") from None
            need(bool(curve) and all(g >= 1 and ms > 0 for g, ms in curve),
                 "cost_curve needs at least one point, rows >= 1 and ms > 0")
            self.cost_curve = sorted(curve)


KV_STORE_BACKENDS = ("memory", "disk", "redis")
_KV_STORE_FIELDS = {"backend", "memory_bytes", "path", "disk_bytes", "url", "redis_bytes", "timeout_s",
                    "retry_interval_s", "max_pending_bytes", "max_fetch_bytes",
                    "fetch_timeout_s"}


@dataclass
class KVStoreConfig:
    """The cross-instance KV store (deepserve/kvstore/): a host-memory LRU tier in front of the `backend` tier.

    backend "memory": the host-memory tier alone; "disk": memory, then files under `path` (a local directory or a
    shared mount several engines use at once); "redis": memory, then the Redis server at `url`. `memory_bytes` 0
    leaves the memory tier out in front of disk / Redis (each tier is still bounded by its own *_bytes)."""
    backend: str
    memory_bytes: int = 1 << 30
    path: str | None = None
    disk_bytes: int = 16 << 30
    url: str | None = None
    redis_bytes: int = 1 << 30
    timeout_s: float = 0.5             # one Redis command; past it the server counts as gone
    retry_interval_s: float = 2.0      # a gone Redis is tried again after this long (meanwhile: recompute)
    max_pending_bytes: int = 1 << 30   # write-behind queue; past it new saves are dropped, never waited for
    max_fetch_bytes: int = 1 << 30     # host bytes of blocks being fetched for admission; past it fetches wait
    fetch_timeout_s: float = 30.0      # a fetch not done by then is given up: its prompt is computed

    @classmethod
    def parse(cls, value: dict[str, Any] | str | KVStoreConfig) -> KVStoreConfig:
        """A kv_store dict (or its JSON text) -> KVStoreConfig. Raises ValueError naming the bad field."""
        if isinstance(value, KVStoreConfig):
            return value
        value = json_dict(value, "kv_store", "{'backend': 'disk', 'path': DIR}")
        unknown = sorted(set(value) - _KV_STORE_FIELDS)
        if unknown:
            raise ValueError(f"kv_store: unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(_KV_STORE_FIELDS))}")
        backend = value.get("backend")
        if backend not in KV_STORE_BACKENDS:
            raise ValueError(f"kv_store.backend must be one of {', '.join(KV_STORE_BACKENDS)}; got {backend!r}")
        if backend == "disk" and not (isinstance(value.get("path"), str) and value["path"]):
            raise ValueError("kv_store.path: the disk backend needs a directory path")
        if backend == "redis" and not (isinstance(value.get("url"), str)
                                       and value["url"].startswith(("redis://", "rediss://", "unix://"))):
            raise ValueError(f"kv_store.url: the redis backend needs a redis://HOST:PORT url; got "
                             f"{value.get('url')!r}")
        config = cls(**value)
        for name in ("memory_bytes", "disk_bytes", "redis_bytes", "max_pending_bytes", "max_fetch_bytes"):
            v = getattr(config, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"kv_store.{name} must be an integer >= 0; got {v!r}")
        if backend == "memory" and config.memory_bytes == 0:
            raise ValueError("kv_store.memory_bytes must be > 0 for the memory backend")
        for name in ("timeout_s", "retry_interval_s", "fetch_timeout_s"):
            v = getattr(config, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"kv_store.{name} must be a number > 0; got {v!r}")
        return config

    def check_path(self) -> None:
        """The disk tier's directory exists (created if needed) and is writable; ValueError naming kv_store.path."""
        if self.backend != "disk":
            return
        path = os.path.expanduser(self.path)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_store.path: cannot create directory {path!r} ({e.strerror})") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"kv_store.path: directory {path!r} is not writable")


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    speculative: SpeculativeConfig | None = None
    kv_store: KVStoreConfig | None = None
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)


@dataclass
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    quantization: str | None = None
    # "auto" (the model's dtype), float32 / bfloat16 / float16, or fp8 (= fp8_e4m3) / fp8_e5m2 (FP8_KV_NAMES);
    # another dtype than the model's: standard attention and MLA layers only
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    cuda_graph_max_batch_size: int | None = None
    async_scheduling: bool | None = None      # None: on for CUDA devices, off on the CPU
    # {"method": "ngram"|"mtp"|"dspark", "num_speculative_tokens": k, "verify_length": "fixed"|"confidence"}
    # (a dict or its JSON text; SpeculativeConfig says every key).
    speculative_config: dict[str, Any] | str | None = None
    # The cross-instance KV store: {"backend": "memory" | "disk" | "redis", ...} (KVStoreConfig), or its JSON.
    kv_store: dict[str, Any] | str | None = None
    # Batch-invariant mode: a request's logprobs are bitwise the same alone or in any batch (CPU; deepinfer.md
    # section 9). None: DEEPSERVE_BATCH_INVARIANT.
    batch_invariant: bool | None = None
    # Several ranks (ParallelConfig says what each means); one process each, spawned on this host or started by
    # torchrun (deepserve/engine/multi_rank_engine.py).
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    eplb_interval: int = 0
    eplb_window: int = 100
    num_redundant_experts: int = 0

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)
        need(self.dtype in ("auto", *DTYPE_NAMES), f"dtype must be one of auto, {', '.join(DTYPE_NAMES)}; got {self.dtype!r}")
        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"device must be auto, cpu or cuda; got {self.device!r}")
        need(self.load_format in ("auto", "dummy"), f"load_format must be auto or dummy; got {self.load_format!r}")
        need(self.kv_cache_dtype in ("auto", *DTYPE_NAMES, *FP8_KV_NAMES),
             f"kv_cache_dtype must be one of auto, {', '.join(DTYPE_NAMES + FP8_KV_NAMES)}; "
             f"got {self.kv_cache_dtype!r}")
        need(self.quantization in (None, *QUANTIZATIONS),
             f"quantization must be None or one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
        need(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             f"block_size must be a power of two >= 1; got {self.block_size}")
        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        need(self.max_model_len is None or self.max_model_len >= 1,
             f"max_model_len must be >= 1; got {self.max_model_len}")
        need(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}")
        need(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
             f"kv_cache_memory_bytes must be > 0; got {self.kv_cache_memory_bytes}")
        need(self.cuda_graph_max_batch_size is None or self.cuda_graph_max_batch_size >= 1,
             f"cuda_graph_max_batch_size must be >= 1; got {self.cuda_graph_max_batch_size}")
        need(0.0 < self.gpu_memory_utilization <= 1.0,
             f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        self.speculative = SpeculativeConfig.from_dict(self.speculative_config)
        self._validate_parallel(need)
        if self.kv_store is not None:
            KVStoreConfig.parse(self.kv_store)
            need(self.enable_prefix_caching, "kv_store needs enable_prefix_caching (store entries are named by the "
                                             "prefix cache's block hashes)")

    def _validate_parallel(self, need) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "expert_parallel_size", "eplb_window"):
            value = getattr(self, name)
            need(isinstance(value, int) and value >= 1, f"{name} must be an integer >= 1; got {value!r}")
        for name in ("eplb_interval", "num_redundant_experts"):
            value = getattr(self, name)
            need(isinstance(value, int) and value >= 0, f"{name} must be an integer >= 0; got {value!r}")
        check_parallel_sizes(self.parallel_config.world_size, self.tensor_parallel_size, self.expert_parallel_size)
        if self.parallel_config.world_size == 1:
            return
        need(self.speculative is None, "speculative_config is not supported with several ranks yet "
                                       "(tensor_parallel_size / data_parallel_size > 1)")
        need(self.kv_store is None, "kv_store is not supported with several ranks yet")
        need(self.eplb_interval == 0 or self.expert_parallel_size > 1,
             "eplb_interval needs expert_parallel_size > 1 (there is nothing to balance on one rank)")

    @property
    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.data_parallel_size, self.expert_parallel_size,
                              self.eplb_interval, self.eplb_window, self.num_redundant_experts)

    def _prefill_cap_while_decoding(self, device: torch.device) -> int | None:
        """The CPU's default cap; none on a GPU, with an explicit max_num_batched_tokens (the user's budget holds for
        every step) or without chunked prefill (a prompt must then enter whole)."""
        if device.type != "cpu" or self.max_num_batched_tokens is not None or not self.enable_chunked_prefill:
            return None
        return CPU_MAX_PREFILL_TOKENS_WHILE_DECODING

    def _check_gguf(self, path: str, device: "torch.device", batch_invariant: bool) -> None:
        """quantization="gguf" / "gguf_a8" multiply by the file's packed blocks in C kernels: a .gguf model on the
        CPU only."""
        q = self.quantization
        if not path.endswith(".gguf"):
            raise ValueError(f"quantization={q!r} keeps a GGUF file's quantized blocks packed; {path} is not a .gguf "
                             "file (use int8 or w8a8 for other checkpoints)")
        if device.type != "cpu":
            raise ValueError(f"quantization={q!r} runs on the CPU only (C kernels), not on {device}; leave "
                             "quantization unset there to run the dequantized model")
        if batch_invariant:
            raise ValueError(f"quantization={q!r} is not batch-invariant (few rows run the packed kernel, many rows "
                             "an sgemm); turn one of them off")
        if self.parallel_config.world_size > 1:
            raise ValueError(f"quantization={q!r} runs on one rank only (no tensor / data / expert parallelism)")

    def resolve_batch_invariant(self) -> bool:
        """The argument, or DEEPSERVE_BATCH_INVARIANT when it is None."""
        if self.batch_invariant is not None:
            return bool(self.batch_invariant)
        from deepserve import envs
        return bool(envs.DEEPSERVE_BATCH_INVARIANT)

    def resolve_model_path(self) -> str:
        if self.model is None:
            from deepserve.loader.gguf_loader import default_model_path
            return default_model_path()
        path = os.path.expanduser(self.model)
        if not os.path.exists(path):
            raise FileNotFoundError(f"model {self.model!r} is neither a local checkpoint directory nor a .gguf file "
                                    "(deepserve never downloads weights)")
        return path

    def create_engine_config(self) -> EngineConfig:
        path = self.resolve_model_path()
        hf_config = load_hf_config(path)
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, hf_config, device)
        context = int(hf_config.get("max_position_embeddings", 2048))
        max_model_len = self.max_model_len or context
        if max_model_len > context:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context of {context} tokens")
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            # Chunked prefill keeps steps short (decode latency); without it a whole prompt must fit one step.
            max_batched = 2048 if self.enable_chunked_prefill else max(max_model_len, 2048)
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({max_batched}) must be >= "
                             f"max_model_len ({max_model_len})")
        max_batched = max(max_batched, self.max_num_seqs) if self.max_num_batched_tokens is None else max_batched
        kv_dtype = dtype if self.kv_cache_dtype == "auto" else torch_dtype(self.kv_cache_dtype)
        if kv_dtype != dtype and device.type != "cpu" and not is_fp8(kv_dtype):
            # The GPU kernels read the cache in the activations' dtype, or widen 8-bit floats into it.
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} differs from the model dtype {dtype}: "
                             "supported on the CPU only (use kv_cache_dtype='auto' or an fp8 one on the GPU)")
        kv_store = KVStoreConfig.parse(self.kv_store) if self.kv_store is not None else None
        if kv_store is not None:
            kv_store.check_path()
        batch_invariant = self.resolve_batch_invariant()
        if self.quantization in GGUF_QUANTIZATIONS:
            self._check_gguf(path, device, batch_invariant)
        return EngineConfig(
            kv_store=kv_store,
            model=ModelConfig(model=path, hf_config=hf_config, dtype=dtype, max_model_len=max_model_len,
                              load_format=self.load_format, skip_tokenizer_init=self.skip_tokenizer_init,
                              seed=self.seed, quantization=self.quantization,
                              keep_mtp=self.speculative is not None and self.speculative.method == "mtp",
                              dspark=self.speculative is not None and self.speculative.method == "dspark",
                              batch_invariant=batch_invariant),
            cache=CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                              kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                              gpu_memory_utilization=self.gpu_memory_utilization, dtype=kv_dtype),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max_batched,
                                      max_model_len=max_model_len,
                                      enable_chunked_prefill=self.enable_chunked_prefill,
                                      max_prefill_tokens_while_decoding=self._prefill_cap_while_decoding(device),
                                      # Several ranks step in lockstep: the loop runs without overlap.
                                      async_scheduling=self.parallel_config.world_size == 1 and (
                                          device.type == "cuda" if self.async_scheduling is None
                                          else self.async_scheduling)),
            # CUDA graphs of a multi-rank step would capture its collectives: not validated yet, so eager.
            device=DeviceConfig(device=device, enforce_eager=self.enforce_eager or self.parallel_config.world_size > 1,
                                cuda_graph_max_batch_size=self.cuda_graph_max_batch_size),
            speculative=self.speculative,
            parallel=self.parallel_config,
        )


def load_hf_config(path: str) -> dict[str, Any]:
    if path.endswith(".gguf"):
        from deepserve.loader.gguf_loader import load_gguf
        return load_gguf(path).config
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path} has no config.json")
    with open(config_path) as f:
        config = json.load(f)
    # Multimodal releases (DeepSeek-V4.1) keep the language model's fields under text_config: they win over the
    # top level (deepinfer.md §16.1), which keeps the rest (architectures, token ids, quantization_config).
    if isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}
    return config


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, hf_config: dict[str, Any], device: torch.device) -> torch.dtype:
    import torch

    if name != "auto":
        return torch_dtype(name)
    if device.type == "cpu":
        # fp32 is the fastest and most exact choice on CPUs without AMX (measured: bf16 GEMMs are
        # slower than fp32 on AVX-512 Xeons for the small matrices of small models).
        return torch.float32
    declared = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    return {"float16": torch.float16, "float32": torch.bfloat16}.get(declared, torch.bfloat16)
