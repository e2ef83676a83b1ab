"""engine/startup_heap.py: once an LLM has started, the objects alive are frozen (full garbage collections skip
them) until the LLM handle is garbage; DEEPSERVE_GC_FREEZE=0 leaves the collector alone."""

from __future__ import annotations

import gc
import weakref

from deepserve import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class Node:
    """A reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_an_llm_freezes_its_start_up_objects_until_it_is_garbage(tiny_llama, monkeypatch):
    monkeypatch.setenv("DEEPSERVE_GC_FREEZE", "1")      # the default; tests/conftest.py turns it off elsewhere
    gc.unfreeze()
    tracked_before = len(gc.get_objects())           # what a full collection walks (the frozen ones are not listed)
    cycle = Node()
    alive = weakref.ref(cycle)
    llm = LLM(tiny_llama, skip_tokenizer_init=True)
    assert gc.get_freeze_count() > tracked_before // 2    # the process's objects, the engine's among them
    assert len(gc.get_objects()) < tracked_before // 10
    assert llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids   # still serves
    del cycle
    gc.collect()
    assert alive() is not None                       # frozen: full collections no longer walk it
    del llm
    assert gc.get_freeze_count() == 0                # released with the LLM handle ...
    gc.collect()
    assert alive() is None                           # ... so cycles that died meanwhile are collected


def test_gc_freeze_off_leaves_the_collector_alone(tiny_llama, monkeypatch):
    gc.unfreeze()
    monkeypatch.setenv("DEEPSERVE_GC_FREEZE", "0")
    llm = LLM(tiny_llama, skip_tokenizer_init=True)
    assert gc.get_freeze_count() == 0
    del llm
