"""GrammarSpec -> xgrammar CompiledGrammar, once per distinct spec, off the engine's thread.

- `check(spec)` parses the schema / regex / EBNF into an xgrammar Grammar (milliseconds, no vocabulary work)
  and raises a ValueError naming what is wrong: the engine calls it in add_request, so a bad schema fails
  that request alone, before it is queued.
- `submit(spec)` returns a Future of the compiled grammar (the per-token mask tables, the slow part): one
  compile per distinct `spec.key` runs in a small thread pool, and every request with that key shares the
  Future (an LRU of DEEPSERVE_SO_CACHE_SIZE entries; a failed compile is not kept, so it can be retried).

Thread-safety: `submit` and `check` may be called from any thread (the server's front and the engine thread);
the cache and the lazily built xgrammar compiler are guarded by one lock.

JSON is compiled compact (no free whitespace between tokens): a small model sampling whitespace could
otherwise loop on it until max_tokens. Choices become an EBNF alternation of JSON-escaped string literals.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from deepserve import envs
from deepserve.structured.spec import GrammarSpec

# xgrammar prefixes its messages with "[hh:mm:ss] /project/cpp/file.cc:123: ".
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        """`tokenizer`: a deepserve Tokenizer (its HF backend gives xgrammar the vocabulary); `vocab_size`: the
        model's logits width (may exceed the tokenizer's: the extra ids are never allowed)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._xgr_compiler = None
        self._tokenizer_info = None

    # --- front ---------------------------------------------------------------------------------
    def check(self, spec: GrammarSpec) -> None:
        """Raise ValueError if the spec's grammar does not parse (also: no tokenizer to compile against)."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs: needs the tokenizer (the engine runs with skip_tokenizer_init)")
        to_grammar(spec)

    def submit(self, spec: GrammarSpec) -> Future:
        """A Future of the spec's CompiledGrammar; its exception is a ValueError describing the failure."""
        with self._lock:
            future = self._futures.get(spec.key)
            if future is not None:
                self._futures.move_to_end(spec.key)
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=envs.DEEPSERVE_SO_COMPILE_THREADS,
                                                thread_name_prefix="deepserve-grammar")
            future = self._pool.submit(self._compile, spec)
            self._futures[spec.key] = future
            while len(self._futures) > envs.DEEPSERVE_SO_CACHE_SIZE:
                self._futures.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_failure(spec, f))
        return future

    def compile(self, spec: GrammarSpec):
        """The CompiledGrammar, waiting for it (tests and benchmarks)."""
        return self.submit(spec).result()

    def prepare(self) -> None:
        """Build xgrammar's view of the vocabulary now (a one-off ~0.2 s the first compile would otherwise pay)."""
        self._compiler()

    @property
    def cache_size(self) -> int:
        return len(self._futures)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # --- pool thread ----------------------------------------------------------------------------
    def _compile(self, spec: GrammarSpec):
        grammar = to_grammar(spec)
        compiler = self._compiler()
        try:
            return compiler.compile_grammar(grammar)
        except RuntimeError as e:
            raise ValueError(f"structured_outputs: the grammar does not compile: {_clean(e)}") from None

    def _compiler(self):
        with self._lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr
                self._tokenizer_info = tokenizer_info(self.tokenizer, self.vocab_size)
                self._xgr_compiler = xgr.GrammarCompiler(self._tokenizer_info,
                                                         max_threads=envs.DEEPSERVE_SO_COMPILE_THREADS)
            return self._xgr_compiler

    def _forget_failure(self, spec: GrammarSpec, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._futures.get(spec.key) is future:
                    del self._futures[spec.key]


def tokenizer_info(tokenizer: Any, vocab_size: int):
    """xgrammar's view of the vocabulary, built offline from the tokenizer's own `tokenizers` backend (the
    byte-level / sentencepiece decoding is read from it by xgrammar); EOS ids are the grammar's stop tokens."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                              stop_token_ids=sorted(tokenizer.eos_token_ids))


def to_grammar(spec: GrammarSpec):
    """The xgrammar Grammar of a spec; ValueError (naming the field) if it does not parse."""
    import xgrammar as xgr
    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.source, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.source)
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.source)
        return xgr.Grammar.from_ebnf(choice_ebnf(spec.choices))
    except RuntimeError as e:
        raise ValueError(f"structured_outputs: invalid {_KIND_NAMES[spec.kind]}: {_clean(e)}") from None


def choice_ebnf(choices: list[str]) -> str:
    # A JSON string literal is also a valid EBNF literal in xgrammar (same escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
               "grammar": "EBNF grammar", "choice": "choice list"}


def _clean(error: Exception) -> str:
    return _XGR_PREFIX.sub("", str(error).strip())
