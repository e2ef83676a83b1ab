"""The flags of `deepserve serve` and their defaults.

Kept apart from the server and free of its imports (fastapi, starlette, the engine), so that building the
CLI's parser, which every command does, loads none of them; server.py reads the parsed flags.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
TOOL_CALL_PARSERS = ("auto", "hermes", "none")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    add_access_args(group)
    group.add_argument("--max-queue", type=int, default=None, metavar="N",
                       help="answer 503 while N requests are already waiting to be scheduled")
    group.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="answer 413 to larger request bodies")
    group.add_argument("--served-model-name", action="append", default=[], dest="served_model_names",
                       metavar="NAME", help="name(s) clients use for the model (default: the model file's name)")
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
                       help="how tool calls are written in the output (auto: from the chat template)")
    group.add_argument("--role", choices=("colocated", "prefill", "decode"), default="colocated",
                       help="prefill/decode disaggregation (needs a shared --kv-store): prefill computes prompts "
                            "into the store for the router's decode replicas (pd_role.py)")
    group.add_argument("--engine-in-process", action="store_true", default=None,
                       help="step the engine on a thread of the server's process instead of in its own process "
                            "(also DEEPSERVE_ENGINE_IN_PROCESS=1; =0 forces the process). Default: the process on a "
                            "GPU, the thread on the CPU; multi-rank and --role prefill servers always use the thread")
    group.add_argument("--drain-timeout", type=float, default=300.0,
                       help="seconds to let in-flight requests finish after SIGTERM")
    group.add_argument("--uvicorn-log-level", default="warning")
    cors = parser.add_argument_group("CORS (off unless --allowed-origins is given)")
    list_help = "a JSON list or comma-separated; repeatable"
    cors.add_argument("--allowed-origins", type=_str_list, action="extend", default=[], metavar="ORIGINS",
                      help=f"origins browsers may call from, e.g. https://app.example.com or '*' ({list_help})")
    cors.add_argument("--allowed-methods", type=_str_list, action="extend", default=None, metavar="METHODS",
                      help=f"HTTP methods allowed cross-origin (default: all; {list_help})")
    cors.add_argument("--allowed-headers", type=_str_list, action="extend", default=None, metavar="HEADERS",
                      help=f"request headers allowed cross-origin (default: all; {list_help})")
    cors.add_argument("--allow-credentials", action="store_true",
                      help="let cross-origin requests send cookies and HTTP authentication")


def add_access_args(group: Any) -> None:
    """The key and rate-limit flags (on a parser or an argument group), the same for `deepserve serve` and `deepserve router` (keys.py reads them,
    auth.py and rate_limit.py enforce them)."""
    group.add_argument("--api-key", action="append", default=[], dest="api_keys", metavar="KEY",
                       help="accept this key (repeat for several); `ps` shows it to every user: prefer "
                            "DEEPSERVE_API_KEY or --api-key-file. Without any key, no authentication")
    group.add_argument("--api-key-file", action="append", default=[], dest="api_key_files", metavar="PATH",
                       help="accept the keys in this file: one per line, blank lines and #comments ignored")
    group.add_argument("--rate-limit", type=float, default=None, metavar="R",
                       help="requests per second allowed per key (per client address without keys)")


def _str_list(value: str) -> list[str]:
    """A list flag: vLLM's JSON form (`'["https://a.example"]'`) or plain `a,b`."""
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"not a JSON list: {error}") from None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return items
    return [item.strip() for item in value.split(",") if item.strip()]
