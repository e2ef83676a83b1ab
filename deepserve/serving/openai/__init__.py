"""The OpenAI-compatible HTTP server: `build_app(ServerContext.create(engine, ServerConfig(...)))`.

The names load on first use (PEP 562): importing a light submodule (`options`, for the CLI's parser) must not
pull in fastapi and the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "build_app": "deepserve.serving.openai.app",
    "ServerConfig": "deepserve.serving.openai.context",
    "ServerContext": "deepserve.serving.openai.context",
}

if TYPE_CHECKING:  # pragma: no cover
    from deepserve.serving.openai.app import build_app
    from deepserve.serving.openai.context import ServerConfig, ServerContext


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = ["ServerConfig", "ServerContext", "build_app"]
