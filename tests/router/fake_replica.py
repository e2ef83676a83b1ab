"""A stand-in for a `deepserve serve` replica, as a real process the tests can kill (SIGKILL), hang (SIGSTOP),
slow down or make fail: `python fake_replica.py --port P`.

It speaks enough of the server's API for the router: /v1/completions and /v1/chat/completions (plain JSON or
SSE, `stream: true`), /v1/models, /health, /metrics (a load report with the server's series names). What it
does is set per test through POST /control (see Behaviour); GET /control tells what it received.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Behaviour:
    status: int = 200                  # answer generation requests with this status (an OpenAI error body)
    delay_s: float = 0.0               # before the answer (plain) or before the first event (stream)
    chunk_delay_s: float = 0.0         # between two events of a stream
    num_chunks: int = 3
    fail_after_chunks: int | None = None   # cut the connection after this many events (0: before any)
    done_linger_s: float = 0.0         # after `data: [DONE]`, before the stream ends (its client may be gone)
    cached_tokens: int | None = None   # set: a final usage chunk (10 prompt tokens, this many from the cache)
    health_status: int = 200
    running: float = 0.0               # the load report on /metrics
    waiting: float = 0.0
    kv_usage: float = 0.0


@dataclass
class Seen:
    requests: int = 0
    paths: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    authorization: list[str | None] = field(default_factory=list)
    streams_finished: int = 0
    streams_cut_by_client: int = 0


class FakeReplica:
    def __init__(self, name: str) -> None:
        self.name = name
        self.behaviour = Behaviour()
        self.seen = Seen()

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/completions", self.generate, methods=["POST"]),
            Route("/v1/chat/completions", self.generate, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/control", self.control, methods=["GET", "POST"]),
        ])

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        b = self.behaviour
        self.seen.requests += 1
        self.seen.paths.append(request.url.path)
        self.seen.prompts.append(str(body.get("prompt", body.get("messages"))))
        self.seen.authorization.append(request.headers.get("authorization"))
        if b.status != 200:
            error = {"error": {"message": f"{self.name} fails", "type": "server_error", "param": None, "code": None}}
            return JSONResponse(error, status_code=b.status)
        if body.get("stream"):
            return StreamingResponse(self.events(b), media_type="text/event-stream")
        await asyncio.sleep(b.delay_s)
        if b.fail_after_chunks is not None:
            raise RuntimeError("the replica fails")      # uvicorn answers 500
        return JSONResponse({"object": "text_completion", "replica": self.name,
                             "choices": [{"index": 0, "text": "".join(f"c{i}" for i in range(b.num_chunks)),
                                          "finish_reason": "length"}]})

    async def events(self, b: Behaviour):
        try:
            await asyncio.sleep(b.delay_s)
            for i in range(b.num_chunks):
                if b.fail_after_chunks is not None and i >= b.fail_after_chunks:
                    raise RuntimeError("the replica dies mid-stream")   # uvicorn cuts the connection
                if i:
                    await asyncio.sleep(b.chunk_delay_s)
                chunk = {"replica": self.name, "sent_at": time.time(), "choices": [{"index": 0, "text": f"c{i}"}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            if b.cached_tokens is not None:
                usage = {"prompt_tokens": 10, "completion_tokens": b.num_chunks,
                         "prompt_tokens_details": {"cached_tokens": b.cached_tokens}}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            await asyncio.sleep(b.done_linger_s)
            self.seen.streams_finished += 1
        except asyncio.CancelledError:
            self.seen.streams_cut_by_client += 1
            raise

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", "replica": self.name}]})

    async def health(self, _: Request) -> Response:
        return Response(status_code=self.behaviour.health_status)

    async def metrics(self, _: Request) -> Response:
        b = self.behaviour
        text = (f'deepserve:num_requests_running{{model_name="fake"}} {b.running}\n'
                f'deepserve:num_requests_waiting{{model_name="fake"}} {b.waiting}\n'
                f'deepserve:kv_cache_usage_perc{{model_name="fake"}} {b.kv_usage}\n')
        return Response(text, media_type="text/plain")

    async def control(self, request: Request) -> Response:
        if request.method == "POST":
            changes = await request.json()
            if changes.pop("reset", False):
                self.behaviour, self.seen = Behaviour(), Seen()
            for key, value in changes.items():
                setattr(self.behaviour, key, value)
        return JSONResponse({"name": self.name, "behaviour": asdict(self.behaviour), "seen": asdict(self.seen)})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    replica = FakeReplica(f"fake-{args.port}")
    uvicorn.run(replica.app(), host="127.0.0.1", port=args.port, log_level="error", access_log=False)


if __name__ == "__main__":
    main()
