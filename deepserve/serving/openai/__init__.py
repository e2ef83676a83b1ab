"""The OpenAI-compatible HTTP server: `build_app(ServerContext.create(engine, ServerConfig(...)))`.

The names load on first use (PEP 562): importing a light submodule (`options`, for the CLI's parser) must not
pull in fastapi and the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepserve.lazy import lazy_exports

_EXPORTS = {
    "build_app": "deepserve.serving.openai.app",
    "ServerConfig": "deepserve.serving.openai.context",
    "ServerContext": "deepserve.serving.openai.context",
}

if TYPE_CHECKING:  # pragma: no cover
    from deepserve.serving.openai.app import build_app
    from deepserve.serving.openai.context import ServerConfig, ServerContext


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["ServerConfig", "ServerContext", "build_app"]
