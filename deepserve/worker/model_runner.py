"""ModelRunner: owns the model and its KV cache; turns a SchedulerOutput into sampled tokens.

launch(SchedulerOutput) -> LaunchedStep, without waiting for the device:
  1. copy-on-write block copies;
  2. build_forward_batch (host -> device once), or the static inputs of a captured CUDA graph;
  3. model forward -> hidden states of the rows that need logits;
  4. logits -> Sampler (rows that sample) and prompt logprobs (rows that asked for them);
  5. sampled tokens start their copy to the host.
collect(LaunchedStep) -> ModelRunnerOutput of plain Python values keyed by seq_id (waits for the copy).
execute = collect(launch(...)); the engine overlaps them when it schedules ahead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from deepserve import envs
from deepserve.config import EngineConfig, is_fp8
from deepserve.layers.attention import Attention, TorchPagedAttention
from deepserve.layers.mla import MLAAttention
from deepserve.layers.forward_batch import ForwardBatch
from deepserve.layers.rank_group import ParallelContext
from deepserve.layers.sampler import Sampler, SamplerOutput, SamplingMetadata, SequenceSamplingRow
from deepserve.spec_decode.dspark import DSparkDraft, draft_blocks, run_dspark
from deepserve.spec_decode.mtp import MTPDraft, MTPScratch, mtp_rows, run_mtp
from deepserve.spec_decode.verifier import VerifyGroup, verify
from deepserve.worker.model_loader import load_model
from deepserve.worker.batch_builder import build_forward_batch
from deepserve.worker.host_memory import retain_freed_memory
from deepserve.worker.kv_cache import KVCacheLayout
from deepserve.worker.mixed_graph import mixed_buckets
from deepserve.worker.kv_budget import KVCacheBudget
from deepserve.worker.launched_step import LaunchedStep, TokenLogprobs, patch_inflight_tokens, to_host
from deepserve.worker import prompt_logprobs
from deepserve.worker.memory_profile import MAX_LOGPROBS, CudaMemory, costliest_sampling
from deepserve.worker.scheduler_output import ScheduledSequence, SchedulerOutput

logger = logging.getLogger(__name__)

@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[int, int] = field(default_factory=dict)          # seq_id -> token
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)          # seq_id -> sampled token's
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)  # seq_id -> this chunk's
    # Speculative decoding: sequences that verified drafts emit several tokens (accepted drafts + one).
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)                # seq_id -> emitted tokens
    spec_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)       # seq_id -> one per token
    num_accepted_drafts: dict[int, int] = field(default_factory=dict)
    # seq_id -> the next step's drafts of a model-based drafter (DeepSeek-V3's MTP layer, V4.1's DSpark blocks)
    mtp_drafts: "dict[int, MTPDraft | DSparkDraft]" = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, eos_token_ids: set[int], memory: "CudaMemory | None" = None,
                 parallel: ParallelContext | None = None) -> None:
        """`memory`: what sizes the KV cache from a profile of the largest step (default: the CUDA device's
        allocator on a GPU; none on the CPU, whose cache is sized from the config alone). `parallel`: this rank's
        groups when the engine has several ranks (the model is then this rank's shard of it)."""
        self.config = config
        self.parallel = parallel or ParallelContext()
        # Expert parallelism across replicas: every rank must enter each MoE layer's all-to-all at every step, so a
        # rank with nothing scheduled runs a placeholder forward, which writes its one token into a scratch block
        # beyond the block manager's (no sequence's KV is touched).
        self.needs_placeholder_steps = self.parallel.ep.size > self.parallel.tp.size
        self.device = config.device.device
        self.memory = memory if memory is not None or self.device.type != "cuda" else CudaMemory(self.device)
        # What this process had allocated before this engine (another engine's weights and KV cache): the profile
        # counts this engine's own memory only, so a second engine in one process is sized by its own share. Dropped
        # engines' memory is reclaimed first.
        if self.memory is not None:
            self.memory.reclaim()
        self._memory_before = self.memory.allocated() if self.memory is not None else 0
        self.block_size = config.cache.block_size
        self.eos_token_ids = eos_token_ids
        if self.device.type == "cpu":
            retain_freed_memory()       # no page faults for each step's large tensors (worker/host_memory.py)
        t0 = time.perf_counter()
        self.model = load_model(config.model, self.device, self.parallel, config.parallel)
        self.load_seconds = time.perf_counter() - t0
        self.expert_balancer = self._build_expert_balancer()
        self._check_kv_cache_dtype()
        # Builds the per-step index metadata every layer's backend reads (one builder for the whole model).
        self.attn_backend = self._select_attention_backend()
        self.sampler = Sampler()
        self.kv_layout = KVCacheLayout(self.model, config, self.kv_cache_dtype)
        self.kv_caches = self._allocate_kv_cache()
        self.mtp_scratch = self._allocate_mtp_scratch()
        self.cuda_graphs = self._capture_cuda_graphs()

    def _check_kv_cache_dtype(self) -> None:
        """A cache dtype other than the model's: standard and latent attention layers only; 8-bit floats on a GPU
        need the conversions of compute capability 8.9 (Ada, Hopper) and newer, which the Triton kernels use."""
        dtype = self.kv_cache_dtype
        if dtype != self.config.model.dtype and not all(
                isinstance(layer, (Attention, MLAAttention)) for layer in self.model.attention_layers()):
            raise ValueError("a kv_cache_dtype other than the model's is supported for standard attention and "
                             "DeepSeek-V2/V3's latent attention only (not DeepSeek-V4's paged states)")
        if is_fp8(dtype) and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError(f"kv_cache_dtype {dtype} needs a GPU of compute capability 8.9 or newer; this one is "
                             f"{torch.cuda.get_device_capability(self.device)}")

    def _build_expert_balancer(self):
        """Expert parallelism: the window of expert counts, the rebalancing and the moe_lb metric."""
        if self.parallel.ep.size == 1:
            return None
        from deepserve.worker.expert_balancer import ExpertBalancer
        pc = self.config.parallel
        return ExpertBalancer(self.model.moe_layers(), self.parallel.ep, self.parallel.tp.size, pc.eplb_interval,
                              pc.eplb_window)

    def _select_attention_backend(self):
        """The backend whose `build_metadata` runs once per step. On a CUDA device with Triton: Triton kernels for
        standard attention, MLA and MoE layers; the PyTorch references everywhere else."""
        # Batch-invariant mode: every row attends as a decode row (layers/batch_invariant.py; CPU only).
        reference = TorchPagedAttention(rows_as_decodes=self.config.model.batch_invariant)
        layers = self.model.attention_layers()
        if self.device.type != "cuda":
            return reference
        from deepserve.kernels import HAS_TRITON
        if not HAS_TRITON:
            return reference
        from deepserve.layers.moe_triton import select_moe_and_mla_backends
        select_moe_and_mla_backends(self.model, self.device)
        if not all(hasattr(layer, "backend") for layer in layers):
            return reference            # paged states without a per-layer backend (DeepSeek-V4.1): the model's own
        if all(isinstance(layer.backend, TorchPagedAttention) for layer in layers):
            from deepserve.layers.attention_triton import TritonPagedAttention
            triton_backend = TritonPagedAttention(rows_as_decodes=self.config.model.batch_invariant)
            for layer in layers:
                layer.backend = triton_backend
            return triton_backend
        shared = {id(layer.backend) for layer in layers}
        if len(shared) == 1 and hasattr(layers[0].backend, "build_metadata"):
            return layers[0].backend       # e.g. TritonMLA: one backend object builds every layer's metadata
        return reference

    # --- KV cache -----------------------------------------------------------------------------
    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.config.cache.dtype or self.config.model.dtype

    def window_states(self) -> list:
        """Per-position states read only a bounded way back (DeepSeek-V4 / V4.1): they live in the window pool."""
        return self.kv_layout.window_states()

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block of the main pool over every layer's cache."""
        return self.kv_layout.main_bytes_per_block()

    def window_bytes_per_block(self) -> int:
        """Bytes of one block of the window pool (0: the model has none)."""
        return self.kv_layout.window_bytes_per_block()

    def kv_bytes_per_token(self) -> float:
        return self.kv_bytes_per_block() / self.block_size

    @property
    def profiled_peak_bytes(self) -> int | None:
        """The start-up profile's peak (weights + the largest step; worker/kv_budget.py); None if none ran."""
        return self.kv_budget.peak_bytes

    def _allocate_kv_cache(self) -> list[torch.Tensor]:
        self.kv_budget = KVCacheBudget(self.config, self.model, self.kv_layout, self.memory, self._memory_before,
                                       self._dummy_forward)
        num_blocks, num_window = self.kv_layout.split(int(self.kv_budget.budget_bytes()))
        # Every rank gets the same number of blocks (tensor-parallel ranks must schedule alike; DeepInfer takes the
        # world's minimum too).
        num_blocks = int(self.parallel.world.all_reduce_min(torch.tensor([num_blocks])).item())
        if num_window:
            num_window = int(self.parallel.world.all_reduce_min(torch.tensor([num_window])).item())
            self.config.cache.window_reach = self.model.window_reach()
        self.config.cache.num_blocks, self.config.cache.num_window_blocks = int(num_blocks), num_window
        # + the scratch block: placeholder forwards write their token there, and paged states their slot -1 (padding
        # rows of a captured decode, entries a decode row does not complete: layers/paged_state.py).
        scratch = self.needs_placeholder_steps or any(getattr(layer, "writes_scratch_slot", False)
                                                      for layer in self.model.attention_layers())
        caches = self.kv_layout.allocate(num_blocks, num_window, scratch, self.device)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    num_blocks * self.kv_bytes_per_block() / 2**20)
        if num_window:
            logger.info("window states: %d blocks (%.1f MiB), %d positions kept behind each sequence's next",
                        num_window, num_window * self.window_bytes_per_block() / 2**20, self.model.window_reach())
        return caches

    def _allocate_mtp_scratch(self) -> MTPScratch | None:
        """MTP drafting with k > 1: blocks appended to the MTP layer's cache (after whatever the runner allocated),
        for the chain rows that fall past a sequence's blocks (spec_decode/mtp.py says why they do not come from the
        block manager). max_num_seqs x ceil((k - 1) / block_size) blocks of one layer: small, and left out of the
        profiled KV budget."""
        spec = self.config.speculative
        if not _drafts_with_mtp(self.model) or spec is None or spec.num_speculative_tokens == 1:
            return None
        layer = self.model.mtp_attention()
        per_seq = MTPScratch.blocks_per_sequence(spec.num_speculative_tokens, self.block_size)
        num_seqs = self.config.scheduler.max_num_seqs
        old, dim = layer.kv_cache, layer.kv_block_dim
        shape = list(old.shape)
        first = shape[dim]
        shape[dim] += num_seqs * per_seq
        # The cache holds nothing yet: free it before allocating the larger one (never both at once on the GPU).
        i = next(i for i, cache in enumerate(self.kv_caches) if cache is old)
        self.kv_caches[i] = layer.kv_cache = old = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.kv_caches[i] = layer.kv_cache = torch.zeros(shape, dtype=self.kv_layout.cache_dtype(layer),
                                                         device=self.device)
        logger.info("MTP chain scratch: %d blocks", num_seqs * per_seq)
        return MTPScratch(first, per_seq, num_seqs)

    def _dummy_forward(self, query_lens: list[int], seq_len: int, sample: bool = True) -> None:
        """A step of one chunk per entry of `query_lens`, each ending at position `seq_len` (decodes at the longest
        context, chunks over a prefix: the widest attention), then the most `launch` does with its hidden states:
        the hidden state of every row (prompt logprobs may ask for all of them), one slice of prompt-logprob logits
        with its float32 softmax, and the logits of one row per sequence through the costliest sampling."""
        dev = self.device
        q = torch.tensor(query_lens)
        starts = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(q, 0, out=starts[1:])
        n = int(starts[-1])
        positions = torch.arange(n) - torch.repeat_interleave(starts[:-1] - (seq_len - q), q)
        batch = ForwardBatch(
            input_ids=torch.zeros(n, dtype=torch.int64, device=dev), positions=positions.to(dev),
            slot_mapping=torch.zeros(n, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(len(query_lens), -(-seq_len // self.block_size), dtype=torch.int64, device=dev),
            query_start_loc=starts.to(dev), seq_lens=torch.full((len(query_lens),), seq_len, device=dev),
            query_lens_cpu=list(query_lens), seq_lens_cpu=[seq_len] * len(query_lens),
            logits_indices=torch.arange(n, device=dev), block_size=self.block_size)
        batch.attn_metadata = self._attention_metadata(batch)
        hidden = self.model(batch)
        if not sample:                  # a verification step's cost: every row's logits
            self.model.compute_logits(hidden)
            return
        # launch's prompt logprobs: PROMPT_LOGPROB_ROWS rows at a time, their logits, float32 log-softmax, top-k.
        slice_logits = self.model.compute_logits(hidden[:min(max(query_lens), prompt_logprobs.PROMPT_LOGPROB_ROWS)])
        torch.log_softmax(slice_logits.float(), dim=-1).topk(MAX_LOGPROBS, dim=-1)
        del slice_logits
        # The sampled rows' logits through the sampler's costliest path.
        logits = self.model.compute_logits(hidden[(starts[1:] - 1).to(dev)])
        self.sampler(logits, costliest_sampling(len(query_lens), logits.shape[-1], self.device))

    @torch.inference_mode()
    def placeholder_forward(self) -> None:
        """A one-token forward that writes only the scratch block: a rank with nothing to compute this step still
        enters every collective of the model's forward (the MoE layers' expert-parallel all-to-alls)."""
        dev, scratch = self.device, self.config.cache.num_blocks
        batch = ForwardBatch(
            input_ids=torch.zeros(1, dtype=torch.int64, device=dev), positions=torch.zeros(1, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((1,), scratch * self.block_size, dtype=torch.int64, device=dev),
            block_tables=torch.full((1, 1), scratch, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0, 1], device=dev), seq_lens=torch.ones(1, dtype=torch.int64, device=dev),
            query_lens_cpu=[1], seq_lens_cpu=[1], logits_indices=torch.zeros(1, dtype=torch.int64, device=dev),
            block_size=self.block_size)
        window = self.config.cache.num_window_blocks      # the window pool's scratch block
        if window:
            batch.window_slot_mapping = torch.full((1,), window * self.block_size, dtype=torch.int64, device=dev)
            batch.window_block_tables = torch.full((1, 1), window, dtype=torch.int64, device=dev)
        batch.attn_metadata = self._attention_metadata(batch)
        self.model(batch)

    @torch.inference_mode()
    def measure_step_costs(self, sizes: list[int], context: int, repeats: int = 5) -> list[tuple[int, float]]:
        """[(rows, ms)]: the eager forward plus logits of `rows` decode rows at `context` tokens, timed as DeepInfer
        times its curve (one warm-up, `repeats` timed runs, min and max dropped, mean). The speculative length policy
        prices verification with it. Run after the KV cache exists: the rows write into block 0's first slot, which
        holds nothing yet."""
        if self.cuda_graphs is not None:
            return self._measure_graph_costs(repeats)
        curve = []
        for rows in sizes:
            times = []
            # Large eager steps on a CPU take up to a second: fewer repeats there (the online slope refines them).
            runs = repeats if self.device.type == "cuda" or rows <= 64 else 3
            for i in range(runs + 1):
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                self._dummy_forward([1] * rows, context, sample=False)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                if i:
                    times.append((time.perf_counter() - t0) * 1e3)
            times.sort()
            kept = times[1:-1] if len(times) > 2 else times
            curve.append((rows, sum(kept) / len(kept)))
        return curve

    def _measure_graph_costs(self, repeats: int) -> list[tuple[int, float]]:
        """[(captured size, ms)] of graph replays (a decode with drafts replays the graph of its row count), timed
        with CUDA events. The static inputs hold padding rows then: every row reads one key of block 0."""
        graphs = self.cuda_graphs
        curve = []
        for size in graphs.sizes:
            times = []
            for i in range(repeats + 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graphs.graph(size).replay()
                end.record()
                end.synchronize()
                if i:
                    times.append(start.elapsed_time(end))
            times.sort()
            kept = times[1:-1] if len(times) > 2 else times
            curve.append((size, sum(kept) / len(kept)))
        return curve

    # --- CUDA graphs --------------------------------------------------------------------------
    def _capture_cuda_graphs(self):
        """Decode graphs on a CUDA device, unless enforce_eager or a layer cannot be captured yet (the PyTorch
        reference backends read host-side lengths, and the reference MoE sorts tokens with data-dependent shapes)."""
        if self.device.type != "cuda" or self.config.device.enforce_eager:
            return None
        from deepserve.layers.moe import TorchMoE
        reference_moe = any(isinstance(layer.backend, TorchMoE) for layer in self.model.moe_layers())
        # Models whose layers read no attention metadata (DeepSeek-V4.1 gathers its own slot lists) need no backend
        # that builds graph metadata.
        reads_metadata = getattr(self.model, "reads_attention_metadata", True)
        if (reads_metadata and not hasattr(self.attn_backend, "build_graph_metadata")) or reference_moe:
            logger.info("CUDA graphs off: this model's layers run eagerly")
            return None
        from deepserve.worker.cuda_graph import CUDAGraphRunner, compact_tables_for, default_capture_sizes
        sched = self.config.scheduler
        # With speculation a decode step has a row per draft too: capture graphs for every sequence verifying all k.
        spec = self.config.speculative
        rows = sched.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
        sizes = default_capture_sizes(min(rows, sched.max_num_batched_tokens),
                                      self.config.device.cuda_graph_max_batch_size)
        # The MTP drafter runs eagerly after sampling, from the final hidden states the graphs keep.
        # Tokens carried from replay to replay (DEEPSERVE_GRAPH_TOKENS): one rank's own argmax (tensor-parallel
        # ranks take rank 0's tokens), no drafter reading the sampled tokens.
        carry = envs.DEEPSERVE_GRAPH_TOKENS and self.parallel.tp.size == 1 and not _drafts_with_mtp(self.model) \
            and not _drafts_with_dspark(self.model)
        graphs = CUDAGraphRunner(self.model, self.attn_backend, self.block_size, sched.max_model_len,
                                 self.config.model.vocab_size, sizes, self.device,
                                 keep_hidden=_drafts_with_mtp(self.model), window=bool(self.window_states()),
                                 mixed_buckets=self._mixed_graph_buckets(), carry_tokens=carry,
                                 compact_tables=compact_tables_for(envs.DEEPSERVE_COMPACT_BLOCK_TABLES,
                                                                   sched.max_model_len, self.block_size),
                                 mapped_io=envs.DEEPSERVE_MAPPED_STEP_IO)
        try:
            graphs.capture()
        except Exception:   # a layer that cannot be captured must not stop the engine: run eagerly instead
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            torch.cuda.synchronize(self.device)
            return None
        return graphs

    def _mixed_graph_buckets(self) -> list[int]:
        """Token buckets of mixed-step graphs (worker/mixed_graph.py), or none: they need an attention backend that
        describes such a step with fixed shapes, one process, and no model drafter (MTP keeps every row's hidden
        state; DSpark runs after the forward on its batch)."""
        if not envs.DEEPSERVE_MIXED_CUDA_GRAPHS or not hasattr(self.attn_backend, "build_mixed_graph_metadata") \
                or self.attn_backend.rows_as_decodes or self.parallel.world.size > 1 \
                or _drafts_with_mtp(self.model) or _drafts_with_dspark(self.model) \
                or not getattr(self.model, "reads_attention_metadata", True):
            return []
        return mixed_buckets(self.config.scheduler.max_num_batched_tokens)

    @property
    def cuda_graph_capture_seconds(self) -> float | None:
        return self.cuda_graphs.capture_seconds if self.cuda_graphs is not None else None

    def copy_blocks(self, copies: list[tuple[int, int]], window_copies: list[tuple[int, int]] = ()) -> None:
        """Copy-on-write copies (src, dst) of the main pool's blocks, and of the window pool's."""
        self.kv_layout.copy_blocks(copies, window_copies, self.device)

    # --- KV blocks in and out (the KV store, engine/kv_store_connector.py; worker/kv_cache.py does the work) -----
    def blocks_not_storable(self) -> str | None:
        return self.kv_layout.blocks_not_storable()

    def read_kv_blocks(self, block_ids: list[int]) -> list[list[torch.Tensor]]:
        return self.kv_layout.read_blocks(block_ids, self.device)

    def write_kv_block(self, block_id: int, tensors: list[torch.Tensor]) -> None:
        self.kv_layout.write_block(block_id, tensors)

    def _attention_metadata(self, batch: ForwardBatch):
        """The backend's per-step metadata, or None for a model whose layers read none (DeepSeek-V4 / V4.1 gather
        their own slot lists: building it would only cost host time)."""
        if not getattr(self.model, "reads_attention_metadata", True):
            return None
        return self.attn_backend.build_metadata(batch)

    # --- one step -----------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run a step and wait for its results."""
        return self.collect(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, previous: "LaunchedStep | None" = None) -> "LaunchedStep":
        """Queue a step's forward and sampling on the device and return without waiting for it.

        Rows whose input token is still in flight (sampled by `previous`, not yet on the host) read it from
        `previous`'s device tensor, so a step can be launched before the one before it has been collected."""
        self.copy_blocks(out.blocks_to_copy, out.window_blocks_to_copy)
        step = LaunchedStep()
        if out.is_empty:
            return step
        graph_size = self.cuda_graphs.size_for(out) if self.cuda_graphs is not None else None

        def patch(input_ids: torch.Tensor, rows: list[tuple[int, int]]) -> None:
            patch_inflight_tokens(input_ids, rows, previous)

        if graph_size is not None:
            # Decode-only: one logits row per sequence; rows of non-final 1-token prompt chunks are not sampled.
            carried = previous.row_of if previous is not None and previous.carried else None
            replay = self.cuda_graphs.run(out, graph_size, patch, carried)
            self._pick_tokens(replay.logits, out.scheduled, step, replay.tokens, replay.host_tokens)
            if _drafts_with_mtp(self.model):      # eagerly, from the hidden states the graph kept
                self._draft_with_mtp(out.scheduled, replay.hidden, step)
            elif _drafts_with_dspark(self.model):  # eagerly; the replay wrote this step's main-cache keys
                first_rows = [0]
                for s in out.scheduled:
                    first_rows.append(first_rows[-1] + s.num_new_tokens)
                self._draft_with_dspark(out.scheduled, replay.batch, step, first_rows[:-1])
            return step
        mixed = self.cuda_graphs.mixed_bucket_for(out) if self.cuda_graphs is not None else None
        if mixed is not None:
            # Prompt work replayed from a graph: one logits row per sequence (its last row); those that sample.
            replay = self.cuda_graphs.run_mixed(out, mixed, patch)
            rows = [b for b, s in enumerate(out.scheduled) if s.samples]
            if rows:
                logits = replay.logits if len(rows) == len(out.scheduled) else replay.logits[rows]
                self._sample(logits, [out.scheduled[b].seq for b in rows], step)
            return step
        prompt_rows = [prompt_logprobs.prompt_logprob_rows(s) for s in out.scheduled]
        drafting_mtp = _drafts_with_mtp(self.model)
        if drafting_mtp:        # the MTP layer reads every row's final hidden state
            logits_rows = [list(range(s.num_new_tokens)) for s in out.scheduled]
        else:
            logits_rows = [p + _sampled_rows(s) for s, p in zip(out.scheduled, prompt_rows)]
        batch = build_forward_batch(out, self.block_size, self.device, logits_rows)
        patch_inflight_tokens(batch.input_ids, batch.inflight_rows, previous)
        batch.attn_metadata = self._attention_metadata(batch)
        hidden = self.model(batch)             # one row per logits row
        offset = 0
        sample_rows, samplers, verify_rows, verifiers = [], [], [], []
        for s, p, rows in zip(out.scheduled, prompt_rows, logits_rows):
            if p:
                step.prompt_logprobs[s.seq.seq_id] = prompt_logprobs.prompt_logprobs(self.model, s,
                                                                                    hidden[offset:offset + len(p)])
            if s.draft_token_ids:
                verify_rows.extend(range(offset + len(p), offset + len(rows)))
                verifiers.append(s)
            elif s.samples:
                sample_rows.append(offset + len(rows) - 1)
                samplers.append(s.seq)
            offset += len(rows)
        wanted = sample_rows + verify_rows
        if wanted:
            # Every hidden row samples in a step without prompt logprobs: no gather then.
            every_row = wanted == list(range(hidden.shape[0]))
            logits = self.model.compute_logits(hidden if every_row else hidden[wanted])
            if samplers:
                self._sample(logits[:len(sample_rows)], samplers, step)
            if verifiers:
                self._verify(logits[len(sample_rows):], verifiers, step)
        if drafting_mtp:
            self._draft_with_mtp(out.scheduled, hidden, step)
        elif _drafts_with_dspark(self.model):
            self._draft_with_dspark(out.scheduled, batch, step)
        return step

    def _draft_with_dspark(self, scheduled: list[ScheduledSequence], batch: ForwardBatch,
                           step: "LaunchedStep", table_rows: list[int] | None = None) -> None:
        """The DSpark blocks for every sequence whose next token is known now; drafts for the next step
        (spec_decode/dspark.py). The forward already wrote this step's main-cache keys. `table_rows`: where each
        sequence's block table is in `batch` (a graph's static batch: the row of its first position)."""
        sampled = dict(zip((seq.seq_id for seq in step.seqs), step.device_tokens.tolist())) if step.seqs else {}
        emitted = {}
        if step.verified is not None:
            emitted = {s.seq.seq_id: e for s, e in zip(step.verified[0], step.verified[1].emitted)}
        blocks = draft_blocks(scheduled, sampled, emitted, self.config.speculative.num_speculative_tokens,
                              self.config.scheduler.max_model_len, table_rows)
        step.mtp_drafts = run_dspark(self.model, batch, blocks, self.eos_token_ids, self.model.spec.sliding_window)

    def _draft_with_mtp(self, scheduled: list[ScheduledSequence], hidden: torch.Tensor, step: "LaunchedStep") -> None:
        """The MTP layer over the rows whose next token is known now, then over its own drafts up to k: drafts for
        the next step (spec_decode/mtp.py). `hidden`: the target's final hidden state of every scheduled position."""
        sampled = dict(zip((seq.seq_id for seq in step.seqs), step.device_tokens.tolist())) if step.seqs else {}
        emitted = {}
        if step.verified is not None:
            emitted = {s.seq.seq_id: e for s, e in zip(step.verified[0], step.verified[1].emitted)}
        next_tokens = [mtp_rows(s, sampled.get(s.seq.seq_id), emitted.get(s.seq.seq_id)) for s in scheduled]
        spec = self.config.speculative
        step.mtp_drafts = run_mtp(self.model, self.attn_backend.build_metadata, scheduled, next_tokens, hidden,
                                  spec.num_speculative_tokens if spec is not None else 1,
                                  self.config.scheduler.max_model_len, self.block_size, self.mtp_scratch)

    def _pick_tokens(self, logits: torch.Tensor, scheduled: list[ScheduledSequence], step: "LaunchedStep",
                     argmax: torch.Tensor | None = None, argmax_host: torch.Tensor | None = None) -> None:
        """Sampling and verification of a graph-replayed decode step: `logits` has one row per scheduled position,
        `argmax` (carried-token graphs) their greedy argmax, `argmax_host` (mapped graphs) its host copy."""
        if all(s.samples and not s.draft_token_ids for s in scheduled):
            # The common step: every row samples, in order.
            self._sample(logits, [s.seq for s in scheduled], step, argmax, argmax_host)
            return
        sample_rows, samplers, verify_rows, verifiers = [], [], [], []
        offset = 0
        for s in scheduled:
            if s.draft_token_ids:
                verify_rows.extend(range(offset, offset + s.num_new_tokens))
                verifiers.append(s)
            elif s.samples:
                sample_rows.append(offset)
                samplers.append(s.seq)
            offset += s.num_new_tokens
        if samplers:
            self._sample(logits if len(sample_rows) == logits.shape[0] else logits[sample_rows], samplers, step)
        if verifiers:
            self._verify(logits[verify_rows], verifiers, step)

    def _verify(self, logits: torch.Tensor, scheduled: list[ScheduledSequence], step: "LaunchedStep") -> None:
        """Rows of sequences with drafts: accept a prefix of the drafts and emit one token more (spec_decode)."""
        groups = [VerifyGroup(s.seq.params, s.seq.seed, s.start + 1, s.draft_token_ids, s.seq.draft_bitmask,
                              s.seq.draft_probs) for s in scheduled]
        requested = [s.seq.params.logprobs for s in scheduled if s.seq.params.logprobs is not None]
        step.verified = (scheduled, verify(logits, groups, max(requested) if requested else None))

    def collect(self, step: "LaunchedStep") -> ModelRunnerOutput:
        """Wait for a launched step's sampled tokens and turn them into plain Python values."""
        result = ModelRunnerOutput(prompt_logprobs=step.prompt_logprobs, mtp_drafts=step.mtp_drafts)
        if step.verified is not None:
            scheduled, verified = step.verified
            for i, s in enumerate(scheduled):
                seq_id = s.seq.seq_id
                result.spec_token_ids[seq_id] = verified.emitted[i]
                result.num_accepted_drafts[seq_id] = verified.num_accepted[i]
                k = s.seq.params.logprobs
                if k is not None and verified.logprobs is not None:
                    result.spec_logprobs[seq_id] = [(tok, lp, ids[:k], vals[:k])
                                                    for tok, lp, ids, vals in verified.logprobs[i]]
        if not step.seqs:
            return result
        if step.ready is not None:
            step.ready.synchronize()
        host = step.host
        token_ids = host.token_ids.tolist()
        lp = host.logprobs.tolist() if host.logprobs is not None else None
        top_ids = host.top_logprob_ids.tolist() if host.top_logprob_ids is not None else None
        top_lp = host.top_logprobs.tolist() if host.top_logprobs is not None else None
        result.sampled_token_ids.update(zip([seq.seq_id for seq in step.seqs], token_ids))
        if lp is None:
            return result       # no row asked for logprobs: no per-row loop
        for i, seq in enumerate(step.seqs):
            k = seq.params.logprobs
            if k is not None:
                ids = top_ids[i][:k] if top_ids is not None else []
                vals = top_lp[i][:k] if top_lp is not None else []
                result.logprobs[seq.seq_id] = (token_ids[i], lp[i], ids, vals)
        return result

    def _sample(self, logits: torch.Tensor, seqs: list, step: "LaunchedStep",
                argmax: torch.Tensor | None = None, argmax_host: torch.Tensor | None = None) -> None:
        """The rows' tokens (and logprobs); `argmax`: the rows' greedy argmax, computed in the graph, which is their
        sample when every row takes the argmax of its raw logits and none asks for logprobs; `argmax_host`: the
        graph's own copy of it in pinned host memory (mapped graphs), which then needs no copy to the host."""
        rows = [SequenceSamplingRow(seq, self.eos_token_ids) for seq in seqs]
        meta = SamplingMetadata.build(rows, logits.shape[-1], self.device)
        host_tokens = None
        if argmax is not None and meta.argmax_of_raw_logits and meta.max_num_logprobs is None:
            # The graphs' buffer, which the next decode replay overwrites: the host reads a copy (to_host's below on
            # a GPU; the CPU stand-in's here; a mapped graph's own, written by its argmax, which the replay after
            # next overwrites: a step is collected before then).
            sampled, step.carried = SamplerOutput(argmax if argmax.is_cuda else argmax.clone(), None, None, None), True
            host_tokens = argmax_host
        else:
            sampled = self.sampler(logits, meta)
        if self.parallel.tp.size > 1:
            # Tensor-parallel ranks keep identical engines: tp rank 0's tokens are everyone's, even where a reduction
            # order left the logits a rounding apart.
            self.parallel.tp.broadcast(sampled.token_ids)
        step.seqs = seqs
        step.row_of = {seq.seq_id: i for i, seq in enumerate(seqs)}
        step.device_tokens = sampled.token_ids
        # Start the copies to the host now, behind this step's work and ahead of the next step's.
        if host_tokens is not None:
            step.host = SamplerOutput(host_tokens, None, None, None)
        else:
            step.host = SamplerOutput(*(to_host(t) for t in (sampled.token_ids, sampled.logprobs,
                                                                sampled.top_logprob_ids, sampled.top_logprobs)))
        if self.device.type == "cuda":
            step.ready = torch.cuda.Event()
            step.ready.record()


def _drafts_with_mtp(model) -> bool:
    """The model was built with DeepSeek-V3's MTP layer for speculative decoding (V4.1's DSpark blocks are
    `_drafts_with_dspark`)."""
    return hasattr(model, "mtp_step") and model.mtp is not None


def _drafts_with_dspark(model) -> bool:
    """DeepSeek-V4.1 built for speculative decoding with its DSpark draft blocks (enable_dspark)."""
    return bool(getattr(model, "dspark_targets", ()))


def _sampled_rows(s: ScheduledSequence) -> list[int]:
    """Offsets of the rows whose logits pick tokens: the last one, or every row of a decode with drafts (row j
    verifies draft j, the last row follows the final draft)."""
    if s.draft_token_ids:
        return list(range(s.num_new_tokens - len(s.draft_token_ids) - 1, s.num_new_tokens))
    return [s.num_new_tokens - 1] if s.samples else []
