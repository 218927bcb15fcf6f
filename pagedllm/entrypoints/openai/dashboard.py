"""``GET /dashboard``: a live page of the KV cache, and the JSON it polls.

The page (``static/dashboard.html`` + ``static/dashboard.js``, shipped in the package: no CDN,
no build step) polls ``GET /v1/kv_cache/state`` twice a second. That route is guarded by the
API key like every /v1 route; the page itself and its script are static files that reveal
nothing, so they are open, and the page asks for the key (or takes ``#key=...``) and sends it
as a bearer token. The state is assembled on the engine thread between two steps
(``AsyncLLM.call_in_engine``, ``engine/kv_state.py``). With data parallelism each replica has
its own pool: ``?engine=i`` picks replica i (default 0).
"""

from __future__ import annotations

import functools
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.kv_state import RecentStats, kv_cache_state, recent_summary

STATIC = Path(__file__).parent / "static"
# Static files anyone may fetch (the data behind them needs the key).
DASHBOARD_PATHS = {"/dashboard", "/dashboard/dashboard.js"}


def add_dashboard_routes(app: FastAPI, llm: AsyncLLM) -> list[RecentStats]:
    recents = [RecentStats() for _ in range(llm.data_parallel_size)]  # one per replica
    for i, recent in enumerate(recents):
        llm.add_stat_logger(recent, replica=i)
    page = (STATIC / "dashboard.html").read_bytes()
    script = (STATIC / "dashboard.js").read_bytes()

    @app.api_route("/dashboard", methods=["GET", "HEAD"])
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8")

    @app.api_route("/dashboard/dashboard.js", methods=["GET", "HEAD"])
    async def dashboard_js() -> Response:
        return Response(script, media_type="text/javascript; charset=utf-8")

    @app.get("/v1/kv_cache/state")
    async def kv_state(engine: int = 0) -> Response:
        if not 0 <= engine < len(recents):
            raise ValueError(f"engine must be in 0..{len(recents) - 1} (the data-parallel replicas), got {engine}")
        # A partial of a module-level function: it can be pickled to a replica process.
        state = await llm.call_in_engine(functools.partial(kv_cache_state, recent=None), replica=engine)
        state["recent"] = recent_summary(recents[engine])
        state["engine"], state["data_parallel_size"] = engine, len(recents)
        return JSONResponse(state)

    return recents
