"""Run by tests/engine/test_multi_rank_engine.py under torchrun: every process runs this same script; only rank 0
returns from LLM(...) and prints the greedy tokens as JSON (the other ranks serve it, then exit)."""

import json
import sys

from deepserve import LLM, SamplingParams

if __name__ == "__main__":
    path, prompts, kwargs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    with LLM(path, skip_tokenizer_init=True, device="cpu", dtype="float32", **kwargs) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)
