"""Batch-1 decode at 4k context on the CPU, the default model in quantization="gguf_a8": ms per decoded token (a
4000-token random prompt; 65 output tokens minus 1, over 64; best of 2) of whichever paged_attention.c is in place.
An A/B of two versions of that kernel swaps the source between processes (the build cache is keyed by the source),
rounds alternating; session 52's is benchmarks/cpu_decode_4k_ab_s52.json.

Run:  python benchmarks/cpu_decode_4k_ab.py LABEL
"""

from __future__ import annotations

import json
import sys
import time

import torch

from deepserve import LLM, SamplingParams
from deepserve.loader.gguf_loader import default_model_path


def main() -> None:
    torch.set_num_threads(2)
    llm = LLM(default_model_path(), quantization="gguf_a8", skip_tokenizer_init=True, seed=0, max_model_len=4352)
    gen = torch.Generator().manual_seed(0)
    prompt = {"prompt_token_ids": torch.randint(100, 40000, (4000,), generator=gen).tolist()}

    def seconds(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - t0

    seconds(1)
    best = min((seconds(65) - seconds(1)) / 64 for _ in range(2))
    print(json.dumps({"label": sys.argv[1] if len(sys.argv) > 1 else "",
                      "decode_ms_per_token_at_4k": round(best * 1e3, 2), "tok_s": round(1 / best, 1)}))


if __name__ == "__main__":
    main()
