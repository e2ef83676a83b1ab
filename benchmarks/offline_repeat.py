"""Offline throughput of one engine, measured several times in a row: is a difference between two code trees
more than run-to-run noise? (At Llama-3.2-1B's shape, 256 x 128/128 takes 0.3-0.6 s on an H200: host-side noise
is a large share of it.)

    python benchmarks/offline_repeat.py TREE [--repeats 5]

TREE is a checkout of deepserve (e.g. `git archive <rev> | tar -x -C /tmp/old`); it goes first on sys.path, so
two trees can be compared on the same machine in turn. Random bf16 weights of the Llama-3.2-1B shape, the engine
settings of benchmarks/h200_dense.py, greedy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

LLAMA_3_2_1B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                    head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=500000.0, torch_dtype="bfloat16", hidden_act="silu")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tree")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))
    from deepserve.bench.throughput import run_throughput
    from deepserve.llm import LLM

    model = tempfile.mkdtemp()
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(LLAMA_3_2_1B, f)
    start = time.perf_counter()
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.5)
    print(args.tree, "startup_s", round(time.perf_counter() - start, 2), flush=True)
    for i in range(args.repeats):
        result = run_throughput(llm, 256, 128, 128, temperature=0.0)
        print(args.tree, i, result["elapsed_s"], result["output_tokens_per_s"], flush=True)


if __name__ == "__main__":
    main()
