"""HF `architectures[0]` -> model class. New model families register here."""

from __future__ import annotations

from torch import nn

from deepserve.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from deepserve.models.deepseek_v41 import DeepseekV41ForCausalLM, DeepseekV4ForCausalLM
from deepserve.models.llama import LlamaForCausalLM
from deepserve.models.moe_models import MixtralForCausalLM, Qwen3MoeForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "DeepseekV41ForCausalLM": DeepseekV41ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(_MODELS))}") from None


def supported_architectures() -> list[str]:
    return sorted(_MODELS)
