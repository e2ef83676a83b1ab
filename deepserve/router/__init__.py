"""The router: one OpenAI-compatible endpoint in front of several deepserve replicas (`deepserve router`).

Cache-aware routing over an approximate prefix tree, load from the router's own counts and the replicas'
reports, health probes, retries of requests not yet streamed, circuit breaking, Prometheus metrics.
docs/router.md tells the design; app.py is the entry (`build_router_app(RouterConfig(...))`).

Light at import: no torch, ever (the router process loads no model); fastapi and httpx load with app.py.
"""
