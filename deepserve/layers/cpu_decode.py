"""CPU decode steps of few rows through a Llama stack in one C call (kernels/cpu/llama_decode.c).

At batch 1 the module path makes ~25 small PyTorch ops and ~10 Python calls per layer around its 4 packed GEMVs: as
much time as the GEMVs take on the default model. `CpuDecodeStack` hands all the layers to one C call instead, when
the model is exactly what that kernel computes: pre-norm Llama layers (no q/k norm, plain NeoX rotary, SwiGLU without a
limit), every projection a GGUFLinear, a float32 Linear (the dequantized model) or an Int8Linear (quantization="int8"
/ "w8a8"; both since session 53), the reference attention backend (not batch-invariant), no tensor parallelism.
Anything else, and any step that is not a decode of at most MAX_ROWS rows, takes the module path (the twin).

The kernel is bound to the layers' KV caches: when the model runner binds others (a profiling run's, then the real
ones), the stack is rebuilt at the next step.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from deepserve import envs
from deepserve.kernels.cpu import llama_decode as kernel
from deepserve.layers.attention import TorchPagedAttention
from deepserve.layers.forward_batch import ForwardBatch
from deepserve.layers.gguf_linear import GGUFLinear
from deepserve.layers.linear import Linear
from deepserve.layers.quantization import Int8Linear
from deepserve.layers.norm import RMSNorm
from deepserve.layers.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)

# Rows the packed GEMVs take well (GGUFLinear switches to dequantize + sgemm from 32): decode batches up to here.
MAX_ROWS = 16


def _packed(m: nn.Module) -> kernel.PackedWeight | None:
    """The projection as the kernel takes it: a GGUFLinear's blocks, a float32 Linear's weight (the dequantized
    model: the kernel's f32_gemv) or an Int8Linear's int8 rows and scales (i8_gemv, fp32 activations); None for
    anything else."""
    bias = None if m.bias is None else m.bias.detach()
    if type(m) is GGUFLinear:
        return kernel.PackedWeight(m.blocks, m.qtype, bias, m.int8_activations)
    if bias is not None and bias.dtype != torch.float32:
        return None
    if type(m) is Linear and not m.batch_invariant and m.weight.dtype == torch.float32 and m.weight.is_cpu \
            and m.weight.is_contiguous():
        return kernel.PackedWeight(m.weight.detach(), kernel.F32, bias)
    if type(m) is Int8Linear and m.qweight.is_cpu and m.qweight.is_contiguous():
        return kernel.PackedWeight(m.qweight, kernel.I8, bias, scales=m.scales)
    return None


def _norm_weight(m: nn.Module) -> torch.Tensor | None:
    ok = type(m) is RMSNorm and m.weight.dtype == torch.float32 and m.weight.is_cpu
    return m.weight.detach().contiguous() if ok else None


def _why_not(layer: nn.Module) -> str | None:
    """Why the kernel cannot run this decoder layer (None: it can)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if not all(hasattr(attn, a) for a in ("qkv_proj", "o_proj", "attn", "rotary", "q_norm", "tp")):
        return "not a Llama attention"
    if not all(hasattr(mlp, a) for a in ("gate_up_proj", "down_proj", "swiglu_limit", "tp")) \
            or hasattr(mlp, "expert_load"):
        return "not a dense gated MLP"
    if attn.q_norm is not None or mlp.swiglu_limit is not None or attn.tp.size > 1 or mlp.tp.size > 1:
        return "q/k norms, a SwiGLU limit or tensor parallelism"
    if type(attn.rotary) is not RotaryEmbedding:
        return "not a plain NeoX rotary embedding"
    if type(attn.attn.backend) is not TorchPagedAttention or attn.attn.backend.rows_as_decodes:
        return "another attention backend (or batch-invariant mode)"
    if attn.attn.kv_cache is None:
        return "no KV cache bound yet"
    if any(_packed(p) is None for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
        return "a projection that is not GGUF-packed, a float32 Linear or an Int8Linear"
    if any(_norm_weight(n) is None for n in (layer.input_layernorm, layer.post_attention_layernorm)):
        return "a norm that is not an fp32 RMSNorm"
    return None


def build_stack(layers: list[nn.Module], phase_times: bool = False) -> kernel.DecodeStack:
    """The kernel over these decoder layers (`phase_times`: its build that times its phases, for profiles);
    ValueError (saying why) where it cannot run them."""
    if not layers:
        raise ValueError("no layers")
    for i, layer in enumerate(layers):
        reason = _why_not(layer)
        if reason is not None:
            raise ValueError(f"layer {i}: {reason}")
    first = layers[0].self_attn
    rotary, eps = first.rotary, layers[0].input_layernorm.eps
    if any(layer.self_attn.rotary is not rotary for layer in layers) or \
            any(n.eps != eps for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)):
        raise ValueError("layers with different rotary tables or norm eps")
    cache = first.attn.kv_cache
    if kernel.library(cache.dtype) is None:
        raise ValueError(f"no llama_decode build for a {cache.dtype} KV cache here")
    shape = kernel.StackShape(hidden=layers[0].input_layernorm.weight.shape[0],
                              intermediate=layers[0].mlp.intermediate_size, heads=first.num_heads,
                              kv_heads=first.num_kv_heads, head_dim=first.head_dim, eps=eps, scale=first.attn.scale)
    weights = [kernel.LayerWeights(
        input_norm=_norm_weight(layer.input_layernorm), qkv=_packed(layer.self_attn.qkv_proj),
        o=_packed(layer.self_attn.o_proj), post_norm=_norm_weight(layer.post_attention_layernorm),
        gate_up=_packed(layer.mlp.gate_up_proj), down=_packed(layer.mlp.down_proj),
        kv_cache=layer.self_attn.attn.kv_cache, window=layer.self_attn.attn.sliding_window) for layer in layers]
    return kernel.DecodeStack(weights, shape, rotary.cos_cache, rotary.sin_cache, phase_times=phase_times)


class CpuDecodeStack:
    """A model's decoder layers as one C call per decode step, where the kernel can run them (see the module's
    docstring). Call it with the embeddings and the batch: the residual stream after the last layer (before the final
    norm), or None when the step takes the module path. `enabled` (DEEPSERVE_CPU_FUSED_DECODE) switches it off;
    `phase_times` (benchmarks) builds the kernel that times its phases. After changing the layers (or phase_times),
    `reset()`: the stack is rebuilt at the next step."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers
        self.enabled = envs.DEEPSERVE_CPU_FUSED_DECODE
        self._stack: kernel.DecodeStack | None = None
        self._attns: list[nn.Module] = []          # the built stack's per-layer cache holders
        self._caches: tuple | None = None          # the KV caches the stack (or its refusal) was built for
        self.phase_times = False

    def reset(self) -> None:
        self._stack, self._attns, self._caches = None, [], None

    @property
    def stack(self) -> kernel.DecodeStack | None:
        """The kernel the next decode step runs (None: the module path)."""
        return self._current()

    def _bound_caches(self) -> tuple:
        return tuple(getattr(getattr(getattr(layer, "self_attn", None), "attn", None), "kv_cache", None)
                     for layer in self.layers)

    def _current(self) -> kernel.DecodeStack | None:
        if self._stack is not None and all(a.kv_cache is c for a, c in zip(self._attns, self._caches)):
            return self._stack
        caches = self._bound_caches()
        if self._caches is not None and all(a is b for a, b in zip(caches, self._caches)):
            return None                                          # refused for these caches already
        self._caches, self._stack, self._attns = caches, None, []
        try:
            self._stack = build_stack(list(self.layers), self.phase_times)
            self._attns = [layer.self_attn.attn for layer in self.layers]
        except ValueError as e:
            logger.debug("CPU decode steps go layer by layer: %s", e)
        return self._stack

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        if not self.enabled or not x.is_cpu or x.dim() != 2 or x.shape[0] > MAX_ROWS or x.dtype != torch.float32 \
                or not batch.is_decode_only or any(batch.draft_lens_cpu) or torch.is_grad_enabled():
            return None
        stack = self._current()
        if stack is None:
            return None
        return stack.run(x.contiguous(), batch.positions, batch.slot_mapping, batch.block_tables.contiguous(),
                         batch.seq_lens)


__all__ = ["CpuDecodeStack", "MAX_ROWS", "build_stack"]
