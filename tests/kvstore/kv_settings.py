"""Engine settings shared by the engine-level KV store tests (and conftest's `reference` fixture)."""

from deepserve.sampling_params import SamplingParams

ENGINE = {"skip_tokenizer_init": True, "max_model_len": 1024, "block_size": 16, "max_num_seqs": 8}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
