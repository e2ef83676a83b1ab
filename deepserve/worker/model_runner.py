"""ModelRunner: owns the model and its KV cache; turns a SchedulerOutput into sampled tokens.

execute(SchedulerOutput):
  1. copy-on-write block copies;
  2. ForwardBatch.build (host -> device once);
  3. model forward -> hidden states of the rows that need logits;
  4. logits -> Sampler (rows that sample) and prompt logprobs (rows that asked for them);
  5. return a ModelRunnerOutput of plain Python values, keyed by seq_id.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from deepserve.config import EngineConfig
from deepserve.engine.scheduler import ScheduledSequence, SchedulerOutput
from deepserve.layers.attention import TorchPagedAttention
from deepserve.layers.sampler import Sampler, SamplingMetadata, SequenceSamplingRow
from deepserve.loader.model_loader import load_model
from deepserve.worker.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

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
        t0 = time.perf_counter()
        self.model = load_model(config.model, self.device)
        self.load_seconds = time.perf_counter() - t0
        # Builds the per-step index metadata every layer's backend reads (one builder for the whole model).
        self.attn_backend = self._select_attention_backend()
        self.sampler = Sampler()
        self.kv_caches = self._allocate_kv_cache()

    def _select_attention_backend(self):
        """Triton kernels for standard attention layers on a CUDA device when Triton imports; the PyTorch
        reference everywhere else (and for layers with their own backend, such as MLA, until they get kernels)."""
        reference = TorchPagedAttention()
        layers = self.model.attention_layers()
        if self.device.type != "cuda":
            return reference
        from deepserve.kernels import HAS_TRITON
        if not HAS_TRITON or not all(isinstance(layer.backend, TorchPagedAttention) for layer in layers):
            return reference
        from deepserve.kernels.attention_backend import TritonPagedAttention
        triton_backend = TritonPagedAttention()
        for layer in layers:
            layer.backend = triton_backend
        return triton_backend

    # --- KV cache -----------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        dtype = self.config.model.dtype
        return sum(layer.kv_bytes_per_token(dtype) for layer in self.model.attention_layers())

    def _kv_budget_bytes(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            # Leave room for activations of a max-size step (refined by profiling on the GPU path).
            headroom = 2 << 30
            return max(int(total * cache.gpu_memory_utilization) - used_by_others - headroom, 1 << 20)
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
            cache = torch.zeros(layer.kv_cache_shape(num_blocks, self.block_size), dtype=self.config.model.dtype,
                                device=self.device)
            layer.kv_cache = cache
            caches.append(cache)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    num_blocks * per_block / 2**20)
        return caches

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for layer in self.model.attention_layers():
            dim = layer.kv_block_dim
            layer.kv_cache.index_copy_(dim, dst, layer.kv_cache.index_select(dim, src))

    # --- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.copy_blocks(out.blocks_to_copy)
        result = ModelRunnerOutput()
        if out.is_empty:
            return result
        prompt_rows = [_prompt_logprob_rows(s) for s in out.scheduled]
        logits_rows = [p + ([s.num_new_tokens - 1] if s.samples else []) for s, p in zip(out.scheduled, prompt_rows)]
        batch = ForwardBatch.build(out, self.block_size, self.device, logits_rows)
        batch.attn_metadata = self.attn_backend.build_metadata(batch)
        logits = self.model.compute_logits(self.model(batch))
        offset = 0
        sample_rows, samplers = [], []
        for s, p, rows in zip(out.scheduled, prompt_rows, logits_rows):
            if p:
                result.prompt_logprobs[s.seq.seq_id] = self._prompt_logprobs(s, logits[offset:offset + len(p)])
            if s.samples:
                sample_rows.append(offset + len(rows) - 1)
                samplers.append(s.seq)
            offset += len(rows)
        if samplers:
            self._sample(logits[sample_rows], samplers, result)
        return result

    def _sample(self, logits: torch.Tensor, seqs: list, result: ModelRunnerOutput) -> None:
        rows = [SequenceSamplingRow(seq, self.eos_token_ids) for seq in seqs]
        meta = SamplingMetadata.build(rows, logits.shape[-1], self.device)
        sampled = self.sampler(logits, meta)
        token_ids = sampled.token_ids.tolist()
        lp = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        top_ids = sampled.top_logprob_ids.tolist() if sampled.top_logprob_ids is not None else None
        top_lp = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        for i, seq in enumerate(seqs):
            result.sampled_token_ids[seq.seq_id] = token_ids[i]
            k = seq.params.logprobs
            if k is not None and lp is not None:
                ids = top_ids[i][:k] if top_ids is not None else []
                vals = top_lp[i][:k] if top_lp is not None else []
                result.logprobs[seq.seq_id] = (token_ids[i], lp[i], ids, vals)

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
