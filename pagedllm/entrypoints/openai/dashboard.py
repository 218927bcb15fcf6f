"""``GET /dashboard``: a live page of the KV cache, and the JSON it polls.

The page (``static/dashboard.html`` + ``static/dashboard.js``, shipped in the package: no CDN,
no build step) polls ``GET /v1/kv_cache/state`` twice a second. That route is guarded by the
API key like every /v1 route; the page itself and its script are static files that reveal
nothing, so they are open, and the page asks for the key (or takes ``#key=...``) and sends it
as a bearer token. The state is assembled on the engine thread between two steps
(``AsyncLLM.call_in_engine``, ``engine/kv_state.py``).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.kv_state import RecentStats, kv_cache_state

STATIC = Path(__file__).parent / "static"
# Static files anyone may fetch (the data behind them needs the key).
DASHBOARD_PATHS = {"/dashboard", "/dashboard/dashboard.js"}


def add_dashboard_routes(app: FastAPI, llm: AsyncLLM) -> RecentStats:
    recent = RecentStats()
    llm.engine.stat_loggers.append(recent)
    page = (STATIC / "dashboard.html").read_bytes()
    script = (STATIC / "dashboard.js").read_bytes()

    @app.get("/dashboard")
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8")

    @app.get("/dashboard/dashboard.js")
    async def dashboard_js() -> Response:
        return Response(script, media_type="text/javascript; charset=utf-8")

    @app.get("/v1/kv_cache/state")
    async def kv_state() -> Response:
        return JSONResponse(await llm.call_in_engine(lambda engine: kv_cache_state(engine, recent)))

    return recent
