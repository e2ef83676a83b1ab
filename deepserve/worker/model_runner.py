"""ModelRunner: owns the model and its KV cache; turns a SchedulerOutput into sampled tokens.

launch(SchedulerOutput) -> LaunchedStep, without waiting for the device:
  1. copy-on-write block copies;
  2. ForwardBatch.build (host -> device once), or the static inputs of a captured CUDA graph;
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

from deepserve.config import EngineConfig
from deepserve.engine.scheduler import ScheduledSequence, SchedulerOutput
from deepserve.layers.attention import Attention, TorchPagedAttention
from deepserve.layers.sampler import Sampler, SamplerOutput, SamplingMetadata, SequenceSamplingRow, greedy_tokens
from deepserve.loader.model_loader import load_model
from deepserve.worker.forward_batch import ForwardBatch
from deepserve.worker.host_memory import retain_freed_memory

logger = logging.getLogger(__name__)

_CUDA_GRAPH_RESERVE = 512 << 20   # graph pool (activations of the largest decode batch) and fragmentation

# (token id, logprob, top-k ids, top-k logprobs): one position's log-probabilities, plain Python.
TokenLogprobs = tuple[int, float, list[int], list[float]]


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[int, int] = field(default_factory=dict)          # seq_id -> token
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)          # seq_id -> sampled token's
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)  # seq_id -> this chunk's


class ModelRunner:
    def __init__(self, config: EngineConfig, eos_token_ids: set[int]) -> None:
        self.config = config
        self.device = config.device.device
        self.block_size = config.cache.block_size
        self.eos_token_ids = eos_token_ids
        if self.device.type == "cpu":
            retain_freed_memory()       # no page faults for each step's large tensors (worker/host_memory.py)
        t0 = time.perf_counter()
        self.model = load_model(config.model, self.device)
        self.load_seconds = time.perf_counter() - t0
        if self.kv_cache_dtype != config.model.dtype and not all(
                isinstance(layer, Attention) for layer in self.model.attention_layers()):
            raise ValueError("a kv_cache_dtype other than the model's is supported for standard attention layers "
                             "only (not multi-head latent attention)")
        # Builds the per-step index metadata every layer's backend reads (one builder for the whole model).
        self.attn_backend = self._select_attention_backend()
        self.sampler = Sampler()
        self.kv_caches = self._allocate_kv_cache()
        self.cuda_graphs = self._capture_cuda_graphs()

    def _select_attention_backend(self):
        """The backend whose `build_metadata` runs once per step. On a CUDA device with Triton: Triton kernels for
        standard attention, MLA and MoE layers; the PyTorch references everywhere else."""
        reference = TorchPagedAttention()
        layers = self.model.attention_layers()
        if self.device.type != "cuda":
            return reference
        from deepserve.kernels import HAS_TRITON
        if not HAS_TRITON:
            return reference
        from deepserve.kernels.moe_backend import select_moe_and_mla_backends
        select_moe_and_mla_backends(self.model, self.device)
        if all(isinstance(layer.backend, TorchPagedAttention) for layer in layers):
            from deepserve.kernels.attention_backend import TritonPagedAttention
            triton_backend = TritonPagedAttention()
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

    def kv_bytes_per_token(self) -> int:
        return sum(layer.kv_bytes_per_token(self.kv_cache_dtype) for layer in self.model.attention_layers())

    def _kv_budget_bytes(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.device.type == "cuda":
            return self._profiled_gpu_budget()
        # CPU: enough for every sequence at full length, capped at 1 GiB (zeroing more costs start-up time).
        sched = self.config.scheduler
        want = sched.max_num_seqs * sched.max_model_len * self.kv_bytes_per_token()
        return min(want, 1 << 30)

    def _allocate_kv_cache(self) -> list[torch.Tensor]:
        per_block = self.kv_bytes_per_token() * self.block_size
        num_blocks = max(self._kv_budget_bytes() // per_block, 1)
        self.config.cache.num_blocks = int(num_blocks)
        caches = []
        for layer in self.model.attention_layers():
            cache = torch.zeros(layer.kv_cache_shape(num_blocks, self.block_size), dtype=self.kv_cache_dtype,
                                device=self.device)
            layer.kv_cache = cache
            caches.append(cache)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    num_blocks * per_block / 2**20)
        return caches

    def _profiled_gpu_budget(self) -> int:
        """gpu_memory_utilization x total, minus what is not ours (other processes, the CUDA context), the
        weights, the peak activations of a max-size step (measured by running one), and room for CUDA graphs."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        peak = self._profile_run()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        not_torch = total - free - torch.cuda.memory_reserved(self.device)
        graphs = 0 if self.config.device.enforce_eager else _CUDA_GRAPH_RESERVE
        budget = int(total * self.config.cache.gpu_memory_utilization) - not_torch - peak - graphs
        self.profiled_peak_bytes = peak
        logger.info("memory profile: peak %.2f GiB (weights + activations), other %.2f GiB, KV budget %.2f GiB",
                    peak / 2**30, not_torch / 2**30, budget / 2**30)
        if budget < self.kv_bytes_per_token() * self.block_size:
            raise RuntimeError(f"no GPU memory left for the KV cache (peak {peak / 2**30:.1f} GiB of "
                               f"{total / 2**30:.1f} GiB); lower max_num_batched_tokens or raise "
                               "gpu_memory_utilization")
        return budget

    @torch.inference_mode()
    def _profile_run(self) -> int:
        """One forward of the largest step the scheduler may form: a max_num_batched_tokens-token prefill, with
        logits for max_num_seqs rows. Caches are one dummy block (slot -1 writes nothing; reads hit block 0).

        Then the same at half, a quarter, ... down to one token (not measured): kernels whose launch configuration
        depends on the step size (the fused MoE picks its mode and tiles by tokens per expert) are compiled here,
        at start-up, instead of in the middle of serving (a Triton compile takes 1-4 s)."""
        sched = self.config.scheduler
        n = min(sched.max_num_batched_tokens, sched.max_model_len)
        layers = self.model.attention_layers()
        for layer in layers:
            layer.kv_cache = torch.zeros(layer.kv_cache_shape(1, self.block_size), dtype=self.kv_cache_dtype,
                                         device=self.device)
        peak = None
        while n >= 1:
            self._dummy_forward(n, min(sched.max_num_seqs, n))
            if peak is None:
                torch.cuda.synchronize(self.device)
                peak = torch.cuda.max_memory_allocated(self.device)
            n //= 2
        for layer in layers:
            layer.kv_cache = None
        torch.cuda.synchronize(self.device)
        return peak

    def _dummy_forward(self, n: int, rows: int) -> None:
        """A forward of one n-token prompt over the dummy caches, logits for its last `rows` rows, the sampler's
        log-softmax over them."""
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.zeros(n, dtype=torch.int64, device=dev), positions=torch.arange(n, device=dev),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(1, -(-n // self.block_size), dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0, n], device=dev), seq_lens=torch.tensor([n], device=dev),
            query_lens_cpu=[n], seq_lens_cpu=[n], logits_indices=torch.arange(n - rows, n, device=dev),
            block_size=self.block_size)
        batch.attn_metadata = self.attn_backend.build_metadata(batch)
        logits = self.model.compute_logits(self.model(batch))
        torch.log_softmax(logits, dim=-1)      # the sampler's vocab-sized temporaries
        greedy_tokens(logits)                  # the greedy pick (a Triton kernel on the GPU: compiled here)

    # --- CUDA graphs --------------------------------------------------------------------------
    def _capture_cuda_graphs(self):
        """Decode graphs on a CUDA device, unless enforce_eager or a layer cannot be captured yet (the PyTorch
        reference backends read host-side lengths, and the reference MoE sorts tokens with data-dependent shapes)."""
        if self.device.type != "cuda" or self.config.device.enforce_eager:
            return None
        from deepserve.layers.moe import TorchMoE
        reference_moe = any(isinstance(layer.backend, TorchMoE) for layer in self.model.moe_layers())
        if not hasattr(self.attn_backend, "build_graph_metadata") or reference_moe:
            logger.info("CUDA graphs off: this model's layers run eagerly")
            return None
        from deepserve.worker.cuda_graph import CUDAGraphRunner, default_capture_sizes
        sched = self.config.scheduler
        sizes = default_capture_sizes(sched.max_num_seqs, self.config.device.cuda_graph_max_batch_size)
        graphs = CUDAGraphRunner(self.model, self.attn_backend, self.block_size, sched.max_model_len,
                                 self.config.model.vocab_size, sizes, self.device)
        try:
            graphs.capture()
        except Exception:   # a layer that cannot be captured must not stop the engine: run eagerly instead
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            torch.cuda.synchronize(self.device)
            return None
        return graphs

    @property
    def cuda_graph_capture_seconds(self) -> float | None:
        return self.cuda_graphs.capture_seconds if self.cuda_graphs is not None else None

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for layer in self.model.attention_layers():
            dim = layer.kv_block_dim
            layer.kv_cache.index_copy_(dim, dst, layer.kv_cache.index_select(dim, src))

    # --- one step -----------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run a step and wait for its results."""
        return self.collect(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, previous: "LaunchedStep | None" = None) -> "LaunchedStep":
        """Queue a step's forward and sampling on the device and return without waiting for it.

        Rows whose input token is still in flight (sampled by `previous`, not yet on the host) read it from
        `previous`'s device tensor, so a step can be launched before the one before it has been collected."""
        self.copy_blocks(out.blocks_to_copy)
        step = LaunchedStep()
        if out.is_empty:
            return step
        graph_size = self.cuda_graphs.size_for(out) if self.cuda_graphs is not None else None
        if graph_size is not None:
            # Decode-only: one logits row per sequence; rows of non-final 1-token prompt chunks are not sampled.
            logits, _ = self.cuda_graphs.run(out, graph_size, lambda ids, rows: _patch_inflight(ids, rows, previous))
            rows = [i for i, s in enumerate(out.scheduled) if s.samples]
            if rows:
                self._sample(logits[rows] if len(rows) < len(out.scheduled) else logits,
                             [out.scheduled[i].seq for i in rows], step)
            return step
        prompt_rows = [_prompt_logprob_rows(s) for s in out.scheduled]
        logits_rows = [p + ([s.num_new_tokens - 1] if s.samples else []) for s, p in zip(out.scheduled, prompt_rows)]
        batch = ForwardBatch.build(out, self.block_size, self.device, logits_rows)
        _patch_inflight(batch.input_ids, batch.inflight_rows, previous)
        batch.attn_metadata = self.attn_backend.build_metadata(batch)
        logits = self.model.compute_logits(self.model(batch))
        offset = 0
        sample_rows, samplers = [], []
        for s, p, rows in zip(out.scheduled, prompt_rows, logits_rows):
            if p:
                step.prompt_logprobs[s.seq.seq_id] = self._prompt_logprobs(s, logits[offset:offset + len(p)])
            if s.samples:
                sample_rows.append(offset + len(rows) - 1)
                samplers.append(s.seq)
            offset += len(rows)
        if samplers:
            # Every logits row samples in a step without prompt logprobs: no [rows, vocab] gather then.
            every_row = len(sample_rows) == logits.shape[0]
            self._sample(logits if every_row else logits[sample_rows], samplers, step)
        return step

    def collect(self, step: "LaunchedStep") -> ModelRunnerOutput:
        """Wait for a launched step's sampled tokens and turn them into plain Python values."""
        result = ModelRunnerOutput(prompt_logprobs=step.prompt_logprobs)
        if not step.seqs:
            return result
        if step.ready is not None:
            step.ready.synchronize()
        host = step.host
        token_ids = host.token_ids.tolist()
        lp = host.logprobs.tolist() if host.logprobs is not None else None
        top_ids = host.top_logprob_ids.tolist() if host.top_logprob_ids is not None else None
        top_lp = host.top_logprobs.tolist() if host.top_logprobs is not None else None
        for i, seq in enumerate(step.seqs):
            result.sampled_token_ids[seq.seq_id] = token_ids[i]
            k = seq.params.logprobs
            if k is not None and lp is not None:
                ids = top_ids[i][:k] if top_ids is not None else []
                vals = top_lp[i][:k] if top_lp is not None else []
                result.logprobs[seq.seq_id] = (token_ids[i], lp[i], ids, vals)
        return result

    def _sample(self, logits: torch.Tensor, seqs: list, step: "LaunchedStep") -> None:
        rows = [SequenceSamplingRow(seq, self.eos_token_ids) for seq in seqs]
        meta = SamplingMetadata.build(rows, logits.shape[-1], self.device)
        sampled = self.sampler(logits, meta)
        step.seqs = seqs
        step.row_of = {seq.seq_id: i for i, seq in enumerate(seqs)}
        step.device_tokens = sampled.token_ids
        # Start the copies to the host now, behind this step's work and ahead of the next step's.
        step.host = SamplerOutput(*(_to_host(t) for t in (sampled.token_ids, sampled.logprobs,
                                                            sampled.top_logprob_ids, sampled.top_logprobs)))
        if self.device.type == "cuda":
            step.ready = torch.cuda.Event()
            step.ready.record()

    def _prompt_logprobs(self, s: ScheduledSequence, logits: torch.Tensor) -> list[TokenLogprobs]:
        """Log-probability of each next prompt token given its prefix (raw model distribution)."""
        k = s.seq.params.prompt_logprobs
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(s.seq.token_ids[s.start + 1:s.start + 1 + logits.shape[0]], device=logits.device)
        target_lp = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        entries = []
        for i, tok in enumerate(targets.tolist()):
            entries.append((tok, target_lp[i], top_ids[i].tolist() if k else [], top_vals[i].tolist() if k else []))
        return entries


def _prompt_logprob_rows(s: ScheduledSequence) -> list[int]:
    """Offsets of this chunk's rows whose logits score the next prompt token."""
    seq = s.seq
    if seq.params.prompt_logprobs is None:
        return []
    end = min(s.start + s.num_new_tokens, seq.num_prompt_tokens - 1)
    return list(range(0, max(end - s.start, 0)))


@dataclass
class LaunchedStep:
    """A step queued on the device. Its sampled tokens stay on the device for the next step's inputs and are
    copied to the host asynchronously; `ready` fires when that copy has landed."""
    seqs: list = field(default_factory=list)                 # sequences that sample, in row order
    row_of: dict[int, int] = field(default_factory=dict)     # seq_id -> row in device_tokens
    device_tokens: torch.Tensor | None = None
    host: SamplerOutput | None = None
    ready: "torch.cuda.Event | None" = None
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _patch_inflight(input_ids: torch.Tensor, rows: list[tuple[int, int]], previous: LaunchedStep | None) -> None:
    """input_ids[row] = the token `previous` sampled for that row's sequence, copied on the device."""
    if not rows:
        return
    if previous is None or previous.device_tokens is None:
        raise RuntimeError("a step reads an in-flight token but no launched step holds it")
    device = input_ids.device
    dst = torch.tensor([r for r, _ in rows], dtype=torch.int64).to(device, non_blocking=True)
    src = torch.tensor([previous.row_of[seq_id] for _, seq_id in rows], dtype=torch.int64).to(device,
                                                                                              non_blocking=True)
    input_ids.index_copy_(0, dst, previous.device_tokens.index_select(0, src))
