#!/usr/bin/env bash
# The server against the offline engine on the same workload, in one run (issue 21, "the server delivers a fraction
# of the engine"): offline LLM.generate of 64 prompts at once vs `deepserve bench serve` against `deepserve serve`
# at concurrency 64 and 16 (all requests at once), default model, 128 random-token prompts, 64 output tokens.
#   [CLIENTS=N] bash benchmarks/serve_vs_offline.sh [--device cuda] > benchmarks/serve_vs_offline_cpu.json
# CLIENTS: client processes of `bench serve` (default 1; one Python client saturates near 10k streamed tokens/s,
# benchmarks/serve_client_bound_h200.json). SERVE_PROMPTS: requests the server gets (default 64, the offline batch; more
# measure the server in its steady state, with `max-concurrency` requests in flight all the time).
set -euo pipefail
OUT=$(mktemp -d)
PORT=${PORT:-8155}
python -m deepserve.cli bench throughput --num-prompts 64 --input-len 128 --output-len 64 --output-json "$OUT/offline.json" "$@" >&2
python -m deepserve.cli serve --port "$PORT" --max-model-len 2048 "$@" > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 240); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
python -m deepserve.cli bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts "${SERVE_PROMPTS:-64}" --input-len 128 --output-len 64 \
    --request-rate inf --max-concurrency 64 16 --client-processes "${CLIENTS:-1}" --output-json "$OUT/serve.json" >&2
python - "$OUT" "$*" <<'PY'
import json, sys, os, platform
out, args = sys.argv[1], sys.argv[2]
offline = json.load(open(os.path.join(out, "offline.json")))
serve = json.load(open(os.path.join(out, "serve.json")))
offline_tps = offline["result"]["output_tokens_per_s"]
by_conc = {str(r.get("max_concurrency")): r for r in serve["runs"]}
summary = {c: {"server_output_tok_per_s": r["output_throughput"], "ttft_p50_ms": r["ttft_ms"].get("median"),
               "server_vs_offline": round(r["output_throughput"] / offline_tps, 3)} for c, r in by_conc.items()}
prefix = " ".join(f"{k}={os.environ[k]}" for k in ("CLIENTS", "SERVE_PROMPTS") if k in os.environ)
print(json.dumps({"command": (prefix + " " if prefix else "") + "bash benchmarks/serve_vs_offline.sh " + args, "machine": platform.platform(),
                  "cpu_count": os.cpu_count(), "offline_output_tok_per_s": offline_tps, "summary": summary,
                  "offline": offline, "serve": serve}, indent=1))
PY
