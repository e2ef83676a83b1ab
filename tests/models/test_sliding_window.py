"""Sliding-window attention is not implemented for the Llama family and the MoE models: a config whose window is
shorter than the context served is refused at load (it would otherwise attend past the window and give other tokens
than the model's), and every config that attends to all keys loads. Read from HF transformers' own configs."""

import json
import os

import pytest
import transformers

from deepserve import LLM, SamplingParams
from deepserve.models.base import attention_window
from deepserve.models.llama import LlamaForCausalLM
from deepserve.models.moe_models import MixtralForCausalLM

from tests.conftest import TINY


def _config(config_cls, **overrides) -> dict:
    return config_cls(**TINY, **overrides).to_dict()


@pytest.mark.parametrize("config, window", [
    (_config(transformers.MistralConfig, sliding_window=16), 16),                     # v0.1
    (_config(transformers.MistralConfig, sliding_window=None), None),                 # v0.2 on
    (_config(transformers.Qwen2Config), None),                                        # use_sliding_window False
    (_config(transformers.Qwen2Config, use_sliding_window=True, sliding_window=16, max_window_layers=1), 16),
    (_config(transformers.Qwen2Config, use_sliding_window=True, sliding_window=16, max_window_layers=2), None),
    (_config(transformers.Qwen3Config, use_sliding_window=True, sliding_window=16, max_window_layers=0), 16),
    (_config(transformers.MixtralConfig, sliding_window=16), 16),
])
def test_the_window_some_layer_attends_through(config, window):
    assert attention_window(config) == window
    # The same reading without transformers' per-layer list (configs written before it existed).
    assert attention_window({k: v for k, v in config.items() if k != "layer_types"}) == window


def test_a_window_shorter_than_the_context_is_refused_naming_the_way_out():
    mistral = _config(transformers.MistralConfig, sliding_window=16)
    with pytest.raises(NotImplementedError, match=r"window 16.*max_model_len <= 16"):
        LlamaForCausalLM(mistral, max_position=64)
    LlamaForCausalLM(mistral, max_position=16)          # the window covers the whole context: exact
    mixtral = _config(transformers.MixtralConfig, sliding_window=16, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(NotImplementedError, match="window 16"):
        MixtralForCausalLM(mixtral, max_position=64)


def test_the_engine_refuses_a_windowed_checkpoint_and_serves_it_within_the_window(tmp_path):
    """Through LLM: the refusal names the fix, and the fix works."""
    config = transformers.MistralConfig(**TINY, sliding_window=16)
    transformers.MistralForCausalLM(config).save_pretrained(str(tmp_path))
    assert json.load(open(os.path.join(tmp_path, "config.json")))["sliding_window"] == 16
    with pytest.raises(NotImplementedError, match="max_model_len <= 16"):
        LLM(str(tmp_path), skip_tokenizer_init=True, max_model_len=64)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, max_model_len=16)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
