"""`deepserve serve --role prefill|decode`: a replica's part in prefill/decode disaggregation (router/pd.py).

- prefill: an ordinary engine whose completion answers leave only once its KV store has written every queued
  block (FlushBeforeAnswer): the router sends the request to a decode replica right after, and that replica must
  find the prompt's blocks in the shared store. The router asks it for one token.
- decode: an ordinary engine; its admission loads the prompt's blocks from the shared store (cached tokens).
Both need a store the other replicas reach (kv_store backend disk or redis): checked before the model loads.
"""

from __future__ import annotations

import asyncio
import json

ROLES = ("colocated", "prefill", "decode")
_ANSWERED_AFTER_FLUSH = ("/v1/completions", "/v1/chat/completions")


def check_role(role: str, kv_store) -> None:
    """ValueError unless `role` can work with the engine's kv_store argument (a dict, its JSON, or None)."""
    if role not in ROLES:
        raise ValueError(f"--role must be one of {', '.join(ROLES)}; got {role!r}")
    if role == "colocated":
        return
    if isinstance(kv_store, str):
        try:
            kv_store = json.loads(kv_store)
        except ValueError:
            return                  # EngineArgs reports the bad JSON, naming kv_store
    backend = kv_store.get("backend") if isinstance(kv_store, dict) else None
    if backend not in ("disk", "redis"):
        raise ValueError(f"--role {role} needs a KV store shared with the other replicas: --kv-store with backend "
                         f"disk or redis (got {backend or 'no kv_store'})")


class FlushBeforeAnswer:
    """ASGI wrapper: a completion's last body chunk is sent once the engine's KV store has written its queue."""

    def __init__(self, app, connector, timeout_s: float = 60.0) -> None:
        self.app = app
        self.connector = connector
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in _ANSWERED_AFTER_FLUSH:
            return await self.app(scope, receive, send)

        async def send_after_flush(message):
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                await asyncio.to_thread(self.connector.flush, self.timeout_s)
            await send(message)
        return await self.app(scope, receive, send_after_flush)
