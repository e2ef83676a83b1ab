"""The objects an engine's start-up leaves alive, kept out of the garbage collector's full collections.

Once an engine has started, the Python objects its start-up made (modules and their parameters' wrappers, the
tokenizer's tables, compiled kernels' launchers: about 200k for the default model) live as long as it does, and every
full (generation-2) collection walks all of them again: 90 ms on a 2-core EPYC for the default model, a pause that
lands inside whichever decode step allocates the object that triggers it (benchmarks/gc_pauses.py measures it).
`freeze_startup_heap` collects once and moves everything alive into the permanent generation (`gc.freeze`), as
vLLM's and SGLang's engines do after start-up: full collections then walk only what the engine allocates while it
runs. Reference counting still frees a frozen object whose last reference goes; only cyclic garbage among frozen
objects waits until `release_startup_heap` (the LLM handle calls it when it is garbage-collected, so a process that
builds many engines, a test suite, gets their cycles back).

DEEPSERVE_GC_FREEZE=0 turns it off.
"""

from __future__ import annotations

import atexit
import gc

from deepserve import envs

_unfreeze_at_exit = False


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive; returns how many objects are frozen (0 when turned off)."""
    global _unfreeze_at_exit
    if not envs.DEEPSERVE_GC_FREEZE:
        return 0
    gc.collect()
    gc.freeze()
    if not _unfreeze_at_exit:
        # The interpreter's last collection skips frozen objects: extension objects in cycles would outlive it
        # (nanobind, under Triton, then reports them as leaks).
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    return gc.get_freeze_count()


def started(engine):
    """`engine`, just built, returned after freeze_startup_heap: for a factory whose engine lives as long as its
    process (the server's engine thread)."""
    freeze_startup_heap()
    return engine


def release_startup_heap() -> None:
    """Hand the frozen objects back to the collector (they join the oldest generation)."""
    gc.unfreeze()


__all__ = ["freeze_startup_heap", "release_startup_heap", "started"]
