"""deepserve: an LLM inference engine (vLLM-compatible offline API)."""

from deepserve.config import EngineArgs
from deepserve.llm import LLM
from deepserve.outputs import CompletionOutput, RequestOutput
from deepserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
