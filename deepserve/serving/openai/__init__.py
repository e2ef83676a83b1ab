"""The OpenAI-compatible HTTP server: `build_app(ServerContext.create(engine, ServerConfig(...)))`."""

from deepserve.serving.openai.app import build_app
from deepserve.serving.openai.context import ServerConfig, ServerContext

__all__ = ["ServerConfig", "ServerContext", "build_app"]
