"""deepserve: an LLM inference engine (vLLM-compatible offline API).

The floors (docs/layout.md; tests/unit/test_layering.py keeps them): imports run one way, down.

    entry points   cli.py, llm.py, serving/, bench/, tools/
    engine         engine/ (scheduler, block manager, step loop, async front), sequence.py, outputs.py
    worker         worker/ (model runner, forward-batch builder, CUDA graphs)
    models         models/ (one file per family), loader/ (checkpoints -> models), config.py
    layers         layers/ (attention, MLA, MoE, linear, norm, rotary, sampler): each op dispatches to a kernel
                   or its PyTorch twin in one place
    kernels        kernels/ (Triton kernels, their PyTorch twins under kernels/reference, CPU C kernels)
    leaves         envs.py, version.py, sampling_params.py: import nothing above themselves

`import deepserve` is light: the names below are imported on first use (PEP 562), so `deepserve --help`
and `import deepserve` do not pay for torch, and nothing here pulls in the serving stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from deepserve.version import __version__

_EXPORTS = {
    "LLM": "deepserve.llm",
    "SamplingParams": "deepserve.sampling_params",
    "EngineArgs": "deepserve.config",
    "RequestOutput": "deepserve.outputs",
    "CompletionOutput": "deepserve.outputs",
}

if TYPE_CHECKING:  # pragma: no cover
    from deepserve.config import EngineArgs
    from deepserve.llm import LLM
    from deepserve.outputs import CompletionOutput, RequestOutput
    from deepserve.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deepserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value          # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput", "__version__"]
