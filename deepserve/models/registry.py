"""HF `architectures[0]` -> model class. New model families register here."""

from __future__ import annotations

from torch import nn

from deepserve.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(_MODELS))}") from None


def supported_architectures() -> list[str]:
    return sorted(_MODELS)
