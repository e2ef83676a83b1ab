"""Structured outputs: grammar-constrained decoding through xgrammar.

    spec.py      what a request asks for (SamplingParams.structured_outputs / DeepInfer's so_args) -> GrammarSpec
    compiler.py  GrammarSpec -> xgrammar CompiledGrammar, once per distinct spec, in a thread pool
    matcher.py   one sequence's matcher: token bitmask rows, accept, rollback (speculative drafts)
    trigger.py   so_args triggers: free tokens until a trigger token sequence appears (KMP)
    bitmask.py   the int32 token bitmask (32 tokens a word, bit set = allowed) applied to logits

This room sits on the floor of `sampling_params` (docs/layout.md): the request parameters validate their
spec here, the sampler (layers) applies the bitmask, the runner (worker) fills it, the engine drives the
matchers. xgrammar is imported only by compiler.py and matcher.py, and only when a request uses a grammar,
so `import deepserve` and unconstrained generation never load it.
"""
