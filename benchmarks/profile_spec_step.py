"""Where a speculative decoding step's time goes on a GPU: cProfile of the engine over one mixed copy / free-writing
batch (benchmarks/spec_decode.py's prompts) with prompt-lookup drafts, host functions by own time.

    python benchmarks/profile_spec_step.py [--model PATH.gguf] [--concurrency 64]

Session 9 on an H200 (default model GGUF, c = 64, k = 5): 169 steps in 0.93 s under the profiler, 5.5 ms a step;
`_pick_tokens` 1.9 ms a step (mostly the wait for the graph replay at the first host read), output processing
1.6 ms, n-gram proposals 0.8 ms, graph input fill 0.3 ms.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spec_decode import copy_messages, free_messages  # noqa: E402

from deepserve import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    c = args.concurrency
    llm = LLM(args.model, device=args.device, max_model_len=2048, max_num_seqs=c,
              speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    convs = [copy_messages(i) if i % 2 == 0 else free_messages(i) for i in range(c)]
    params = SamplingParams(temperature=0.0, max_tokens=256)
    llm.chat(convs[:8], params, use_tqdm=False)          # warm-up
    llm.reset_prefix_cache()
    profiler = cProfile.Profile()
    t0 = time.time()
    profiler.enable()
    llm.chat(convs, params, use_tqdm=False)
    profiler.disable()
    print("wall", time.time() - t0, "steps", llm.engine.get_stats().spec_decode_num_steps)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
