"""What every endpoint of one server shares: the engine front, the served model's identity, the config."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from deepserve.config import EngineArgs, resolve_device
from deepserve.engine.async_engine import AsyncEngineFront, AsyncLLMEngine
from deepserve.engine.engine_client import EngineProcessClient
from deepserve.engine.multi_rank_engine import create_engine
from deepserve.engine.startup_heap import started
from deepserve.serving.openai.errors import OpenAIError
from deepserve.serving.openai.metrics import ServerMetrics
from deepserve.serving.openai.options import DEFAULT_MAX_BODY_BYTES
from deepserve.serving.openai.tool_parsers import HermesToolParser, tool_parser_for

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    served_model_names: list[str] = field(default_factory=list)   # empty: the model file/dir's name
    api_keys: list[str] = field(default_factory=list)             # empty: no authentication
    rate_limit: float | None = None                               # requests per second per key (or client)
    max_queue: int | None = None                                  # requests waiting to be scheduled
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    tool_call_parser: str = "auto"                                # auto | hermes | none
    # CORS, for browsers calling from other origins: off while allowed_origins is empty.
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # The engine on a thread of this process (AsyncLLMEngine) rather than in an engine process (EngineProcessClient).
    engine_in_process: bool | None = None   # None: an engine process on a GPU, the thread on the CPU

    def __post_init__(self) -> None:
        if self.rate_limit is not None and self.rate_limit <= 0:
            raise ValueError(f"rate_limit must be > 0 requests/s, got {self.rate_limit}")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if any(not key for key in self.api_keys):
            raise ValueError("an API key must not be empty")


@dataclass
class ServerContext:
    engine: AsyncEngineFront        # AsyncLLMEngine or EngineProcessClient: the same interface
    config: ServerConfig
    metrics: ServerMetrics
    model_names: list[str]
    model_path: str
    tool_parser: HermesToolParser | None
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def create(cls, engine_args: EngineArgs, config: ServerConfig) -> ServerContext:
        """Load the model (in the engine process, or on the engine thread: see AsyncLLMEngine) and wire the
        server around it."""
        tool_parser_for(config.tool_call_parser, None)         # a bad name fails before the slow load
        model_path = engine_args.resolve_model_path()
        names = config.served_model_names or [default_model_name(model_path)]
        metrics = ServerMetrics(names[0])
        in_process = config.engine_in_process
        if in_process is None:
            # On the CPU the engine's own threads are the compute: a second busy process competes with them for
            # cores (2 cores: 141 against 153 tok/s at concurrency 64 for the default model, and 1601 against
            # 2078 for a tiny one, benchmarks/serve_process_split_cpu.json). On a GPU the engine process takes
            # the HTTP / SSE work off the engine loop's GIL.
            in_process = resolve_device(engine_args.device).type != "cuda"
        if not in_process and engine_args.parallel_config.world_size > 1:
            # MultiRankEngine spawns and drives its ranks from the process that builds it (and a daemonic engine
            # process may not start children): it stays on a thread here.
            logger.warning("a multi-rank engine runs on a thread of the server's process (no engine process)")
            in_process = True
        if in_process:
            engine: AsyncEngineFront = AsyncLLMEngine(lambda: started(create_engine(engine_args)),
                                                      max_waiting=config.max_queue, observer=metrics)
        else:
            engine = EngineProcessClient(engine_args, max_waiting=config.max_queue, observer=metrics)
        metrics.watch(engine)
        tokenizer = engine.tokenizer
        template = tokenizer.chat_template if tokenizer is not None else None
        return cls(engine, config, metrics, names, engine.engine.config.model.model,
                   tool_parser_for(config.tool_call_parser, template))

    @property
    def tokenizer(self):
        if self.engine.tokenizer is None:
            raise OpenAIError(400, "this server was started without a tokenizer (skip_tokenizer_init)")
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.config.scheduler.max_model_len

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if name is None or name in self.model_names:
            return name or self.model_name
        raise OpenAIError(404, f"the model {name!r} does not exist; this server serves "
                               f"{', '.join(repr(n) for n in self.model_names)}", param="model",
                          code="model_not_found")


def default_model_name(model_path: str) -> str:
    """`.../SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`; a checkpoint dir -> its name."""
    name = os.path.basename(os.path.normpath(model_path))
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
        stem, _, quant = name.rpartition(".")
        if stem and quant[:1] in ("Q", "F", "I", "B"):   # llama.cpp's quantization suffix (Q4_1, F16, ...)
            name = stem
    return name
