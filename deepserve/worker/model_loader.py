"""Build a model from its config and fill its weights: HF safetensors, GGUF, or random ("dummy")."""

from __future__ import annotations

import contextlib
import glob
import os
import threading
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from deepserve.config import GGUF_QUANTIZATIONS, ModelConfig, ParallelConfig
from deepserve.layers.batch_invariant import make_batch_invariant
from deepserve.layers.rank_group import ParallelContext
from deepserve.layers.quantization import quantize_model
from deepserve.models.registry import get_model_class


def load_model(config: ModelConfig, device: torch.device, parallel: ParallelContext | None = None,
               parallel_config: ParallelConfig | None = None) -> nn.Module:
    """The model with its weights; with several ranks, this rank's shard of it (`parallel`: its groups)."""
    parallel = parallel or ParallelContext()
    sharded = parallel.tp.size > 1 or parallel.ep.size > 1
    # A sharded model is read whole into host memory, cut, and only its shard goes to the device (each rank reads
    # the whole checkpoint: simple, and host memory is the larger one).
    target, device = device, (torch.device("cpu") if sharded else device)
    model = _load_whole(config, device)
    if sharded:
        model = shard_model(model, parallel, parallel_config or ParallelConfig()).to(target)
    if config.quantization in GGUF_QUANTIZATIONS:
        model = _pack_gguf(model, config).eval()
    else:
        model = quantize_model(model, config.quantization).eval()
    return make_batch_invariant(model, target) if config.batch_invariant else model


def _pack_gguf(model: nn.Module, config: ModelConfig) -> nn.Module:
    """quantization="gguf" / "gguf_a8": the GGUF file's Q4_1 / Q8_0 matrices back in packed form
    (layers/gguf_linear.py; gguf_a8: repacked for int8 activations); the fp32 weights the ordinary load made for them
    are dropped with the modules they sat in."""
    from deepserve.layers.gguf_linear import PACKED_TYPES, pack_model
    from deepserve.loader.gguf_loader import load_gguf
    if not config.is_gguf:
        raise ValueError(f"quantization={config.quantization!r} needs a .gguf model; {config.model} is not one")
    return pack_model(model, load_gguf(config.model).packed_tensors(PACKED_TYPES),
                      int8_activations=config.quantization == "gguf_a8")


def shard_model(model: nn.Module, parallel: ParallelContext, parallel_config: ParallelConfig) -> nn.Module:
    """Keep this rank's tensor-parallel shard and expert-parallel experts of a loaded model."""
    if parallel.tp.size > 1:
        if not hasattr(model, "shard_tensor_parallel"):
            raise ValueError(f"tensor_parallel_size > 1 is not supported for {type(model).__name__} (supported: "
                             "Llama / Mistral / Qwen2 / Qwen3, Mixtral / Qwen3-MoE, DeepSeek-V2 / V3)")
        model.shard_tensor_parallel(parallel.tp, shard_experts=parallel.ep.size == 1)
    if parallel.ep.size > 1:
        if not hasattr(model, "shard_tensor_parallel"):     # DeepSeek-V4 / V4.1: hash-routed, FP4 experts
            raise ValueError(f"expert_parallel_size > 1 is not supported for {type(model).__name__} yet (supported: "
                             "Mixtral / Qwen3-MoE, DeepSeek-V2 / V3)")
        moe_layers = model.moe_layers() if hasattr(model, "moe_layers") else []
        if not moe_layers:
            raise ValueError(f"expert_parallel_size > 1 needs a mixture-of-experts model; {type(model).__name__} "
                             "has no MoE layers")
        from deepserve.layers.expert_parallel import enable_expert_parallel
        num_physical = parallel_config.num_physical_experts(moe_layers[0].num_experts)
        enable_expert_parallel(moe_layers, parallel.ep, parallel.tp, num_physical)
    return model


def _load_whole(config: ModelConfig, device: torch.device) -> nn.Module:
    cls = get_model_class(config.architecture)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype if config.dtype.is_floating_point else old_dtype)
    try:
        with torch.device(device), _parameters_left_at_zero():
            extra = {"keep_mtp": True} if config.keep_mtp else {}
            if extra and not hasattr(cls, "mtp_step"):
                raise ValueError(f"speculative_config method 'mtp' needs a model with MTP layers (DeepSeek-V3); "
                                 f"{config.architecture} has none")
            model = cls(config.hf_config, max_position=config.max_model_len, **extra)
    finally:
        torch.set_default_dtype(old_dtype)
    if config.dspark:
        if not hasattr(model, "enable_dspark"):
            raise ValueError(f"speculative_config method 'dspark' needs a DeepSeek-V4.1 model with draft layers "
                             f"(num_nextn_predict_layers > 0); {config.architecture} has none")
        model.enable_dspark()
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        # A model with its own checkpoint format (validated as a whole before reading, e.g. DeepSeek-V4.1's
        # FP8 / FP4 release) reads the directory itself.
        if hasattr(model, "load_checkpoint") and not config.is_gguf:
            loaded = model.load_checkpoint(config.model)
        else:
            loaded = model.load_weights(iter_checkpoint(config.model))
        missing = _expected_params(model) - loaded
        if missing:
            raise ValueError(f"checkpoint {config.model} lacks weights for: {', '.join(sorted(missing)[:8])}")
    return model


# torch.nn.init's random initialisers, which nn.Linear / nn.Embedding call while they are built (the constant ones,
# cheap, are left alone: a module may fill a buffer with them that no checkpoint writes).
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_")
_building = threading.local()


@contextlib.contextmanager
def _parameters_left_at_zero():
    """Build modules with zero-filled parameters instead of PyTorch's random init: every parameter is then written
    by the checkpoint (a missing one is an error) or by init_dummy_weights. Drawing the random numbers cost the
    default model about 1 s of its startup on a 2-core CPU (benchmarks/gguf_startup.json). Only this thread's modules are affected (the initialisers are
    wrapped for the duration, and call through for other threads)."""
    originals = {name: getattr(nn.init, name) for name in _INITIALISERS}

    def zero_here(original):
        def init(tensor, *args, **kwargs):
            if getattr(_building, "active", False):
                with torch.no_grad():
                    return tensor.zero_()
            return original(tensor, *args, **kwargs)
        return init

    for name, original in originals.items():
        setattr(nn.init, name, zero_here(original))
    _building.active = True
    try:
        yield
    finally:
        _building.active = False
        for name, original in originals.items():
            setattr(nn.init, name, original)


def iter_checkpoint(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if path.endswith(".gguf"):
        from deepserve.loader.gguf_loader import load_gguf
        yield from load_gguf(path).tensors()
        return
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of the right shapes, for speed work without a checkpoint (reproducible by seed)."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            # Drawn on the parameter's own device: billions of values on a GPU take a moment, on a CPU minutes.
            gen = generators.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
            param.normal_(0.0, 0.02, generator=gen)


def _expected_params(model: nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters()}
