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

from typing import TYPE_CHECKING

from deepserve.lazy import lazy_exports
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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput", "__version__"]
