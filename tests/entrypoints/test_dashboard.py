"""The KV-cache dashboard: the engine's snapshot, the guarded JSON route, and the page in a real
browser (Debian's chromium + chromium-driver, driven through selenium)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.kv_state import RecentStats, kv_cache_state
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.stats import StepStats
from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import ServerProcess

PROMPT = list(range(3, 3 + 40))  # 40 tokens: 2 full blocks of 16 and a partial one


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, max_model_len=256), log_stats_interval=0)


def test_snapshot_follows_the_pool(engine):
    recent = RecentStats()
    engine.stat_loggers.append(recent)
    try:
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        engine.add_request({"prompt_token_ids": PROMPT}, params, request_id="a")
        engine.step()  # a's prompt computed: its full blocks are in the prefix cache
        engine.add_request({"prompt_token_ids": PROMPT + [7]}, params, request_id="b")
        engine.step()
        state = kv_cache_state(engine, recent)
        ids = [r["request_id"] for r in state["requests"]]
        assert sorted(ids) == ["a", "b"] and {r["queue"] for r in state["requests"]} == {"running"}
        for r in state["requests"]:
            assert 0 < r["num_computed_tokens"] <= r["num_tokens"]
        held = {i: engine.kv_cache_manager.get_block_ids(rid) for i, rid in enumerate(ids)}
        used = {b for blocks in held.values() for b in blocks}
        assert state["num_used_blocks"] == len(used) == state["blocks"].count("u")
        assert state["num_used_blocks"] + state["num_free_blocks"] == state["num_blocks"] == 64
        for i, blocks in held.items():
            for b in blocks:
                assert state["blocks"][b] == "u" and state["owner"][b] in held
        # b adopted a's two full prompt blocks from the prefix cache: shared
        assert state["shared"] == sorted(set(held[0]) & set(held[1]))
        assert len(state["shared"]) == 2
        while engine.has_unfinished_requests():
            engine.step()
        state = kv_cache_state(engine, recent)
        assert state["num_used_blocks"] == 0 and state["requests"] == []
        assert state["num_cached_free_blocks"] > 0 and set(state["blocks"]) <= {"f", "c"}
        assert state["recent"]["prefix_hit_rate_total"] == pytest.approx(32 / 81)
        assert sum(p["generation_tps"] for p in state["recent"]["series"]) * 5 == 60
    finally:
        engine.stat_loggers.remove(recent)


def test_recent_stats_window():
    now = [1000.0]
    recent = RecentStats(window=20, clock=lambda: now[0])
    for t, gen in [(1000, 10), (1004, 20), (1012, 40), (1030, 5)]:
        now[0] = t
        recent.record(StepStats(0, gen, 1, 0, 0.5, 0))
    series = recent.series(bucket=5)
    assert len(series) == 4 and series[-1]["t"] == -4
    # slices 1011-15, 1016-20, 1021-25, 1026-30: seconds 1000 and 1004 fell out of the window
    assert [p["generation_tps"] for p in series] == [40 / 5, 0, 0, 5 / 5]


@pytest.fixture(scope="module")
def server(tiny_llama_tok):
    srv = ServerProcess(["--model", str(tiny_llama_tok), "--num-kv-blocks", "200", "--max-model-len", "512",
                         "--max-num-seqs", "2", "--api-key", "sekrit"])  # fmt: skip
    yield srv
    assert srv.stop() == 0


def test_state_route_needs_the_key_and_the_page_does_not(server):
    assert httpx.get(f"{server.url}/v1/kv_cache/state").status_code == 401
    r = httpx.get(f"{server.url}/v1/kv_cache/state", headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200
    state = r.json()
    assert state["num_blocks"] == 200 and state["num_used_blocks"] == 0 and len(state["blocks"]) == 200
    page = httpx.get(f"{server.url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="/dashboard/dashboard.js"' in page.text and "http" not in page.text.split("<body>")[1]  # no CDN
    js = httpx.get(f"{server.url}/dashboard/dashboard.js")
    assert js.status_code == 200 and "/v1/kv_cache/state" in js.text


def _browser():
    """Headless chromium through the system chromedriver, or skip when it is not installed."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; `make setup` does it where apt works)")
    webdriver = pytest.importorskip("selenium.webdriver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path), options=options)


def _stream(url: str, prompt: str, max_tokens: int, errors: list) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"}, timeout=120) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                pass
    except Exception as e:  # reported by the test thread
        errors.append(e)


def test_dashboard_in_a_real_browser(server, tmp_path):
    browser = _browser()
    try:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        browser.get(f"{server.url}/dashboard#key=sekrit")
        text = lambda element_id: browser.find_element(By.ID, element_id).text  # noqa: E731
        WebDriverWait(browser, 20, poll_frequency=0.05).until(lambda _: text("total-count") == "200")
        assert text("used-count") == "0"
        # Four requests with the same long prefix; two run at once (--max-num-seqs 2), two wait.
        errors: list = []
        prefix = "The quick brown fox jumps over the lazy dog. " * 8
        threads = [threading.Thread(target=_stream, args=(server.url, f"{prefix}{i}", 380, errors)) for i in range(4)]
        for t in threads:
            t.start()
        seen = {}

        def streaming(_) -> bool:
            assert not errors, errors
            rows = browser.find_elements(By.CSS_SELECTOR, "#requests tr.req.running")
            if int(text("used-count") or 0) > 0 and rows:
                seen["used"], seen["rows"] = int(text("used-count")), [r.text for r in rows]
                return True
            return False

        WebDriverWait(browser, 60, poll_frequency=0.05).until(streaming)
        assert seen["used"] > 0 and 1 <= len(seen["rows"]) <= 2
        assert all("running" in row and " / " in row for row in seen["rows"])
        browser.save_screenshot(str(tmp_path / "streaming.png"))
        for t in threads:
            t.join(timeout=120)
        assert not errors
        # After they end: nothing in use, the prompts' blocks stay cached, the queues are empty.
        WebDriverWait(browser, 20, poll_frequency=0.05).until(
            lambda _: text("used-count") == "0" and text("running-count") == "0" and text("waiting-count") == "0"
        )
        assert int(text("cached-count")) > 0
        assert int(text("free-count")) == 200
        assert browser.find_elements(By.CSS_SELECTOR, "#requests tr.req") == []
        assert text("hit-rate").endswith("%") and text("hit-rate") != "0.0%"  # requests 2-4 hit the shared prefix
        # ?engine=r asks the state route for replica r (data parallelism); this server has one.
        browser.get(f"{server.url}/dashboard?engine=0#key=sekrit")
        WebDriverWait(browser, 20, poll_frequency=0.05).until(lambda _: text("total-count") == "200")
        browser.get(f"{server.url}/dashboard?engine=3#key=sekrit")
        WebDriverWait(browser, 20, poll_frequency=0.05).until(lambda _: text("error") == "HTTP 400")
    finally:
        browser.quit()


def test_requests_held_outside_the_queues_count_as_waiting(tiny_llama_tok):
    """Samples waiting for their grammar or for sample 0's prompt are accepted and in flight:
    the gauges, the queue cap and the dashboard count them as waiting (vLLM counts requests
    waiting for a grammar so), and the state after an abort reaches the stat loggers at once."""
    from pagedllm.sampling_params import StructuredOutputsParams

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_tok), num_kv_blocks=64, max_model_len=256), log_stats_interval=1e9)
    seen: list[StepStats] = []
    engine.stat_loggers.append(type("Seen", (), {"record": staticmethod(seen.append)})())
    guided = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    engine.add_request({"prompt_token_ids": PROMPT}, guided, request_id="g")  # held until its grammar is ready
    engine.add_request({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=4, n=3, seed=1), request_id="n3")
    assert len(engine.scheduler.waiting) == 1  # sample 0 of n3; the rest are held
    assert engine.num_waiting() == 4
    state = kv_cache_state(engine)
    assert state["num_waiting"] == 4 and {r["queue"] for r in state["requests"]} == {"waiting"}
    engine.abort_request("g")
    engine.abort_request("n3")
    assert engine.num_waiting() == 0 and kv_cache_state(engine)["requests"] == []
    assert seen and (seen[-1].num_waiting, seen[-1].num_running) == (0, 0)
    assert not engine.has_unfinished_requests()


def test_a_step_that_runs_nothing_still_reports_the_state(tiny_llama_tok, monkeypatch):
    """While the only request waits for its grammar, steps run nothing; the state still reaches
    the stat loggers about once a second (a data-parallel replica reports only what is recorded,
    so its waiting count stayed 0 for the whole compile)."""
    from concurrent.futures import Future

    from pagedllm.sampling_params import StructuredOutputsParams

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_tok), num_kv_blocks=64, max_model_len=256), log_stats_interval=1e9)
    monkeypatch.setattr(engine.structured, "_compile", lambda params: Future())  # a compile that never ends
    seen: list[StepStats] = []
    engine.stat_loggers.append(type("Seen", (), {"record": staticmethod(seen.append)})())
    guided = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    engine.add_request({"prompt_token_ids": PROMPT}, guided, request_id="g")
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        assert engine.step() == []
    assert seen and (seen[-1].num_waiting, seen[-1].num_running, seen[-1].num_generation_tokens) == (1, 0, 0)
    engine.abort_request("g")
    assert not engine.has_unfinished_requests()


def test_blocks_a_beam_holds_between_its_steps_have_an_owner(tiny_llama):
    """A beam that reported keeps its blocks under a holder table until its siblings report;
    under KV pressure the dashboard showed those blocks in use and owned by no one."""
    from pagedllm.engine.beam_search import BeamSearchParams

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), num_kv_blocks=16, max_model_len=250, max_num_seqs=4),
                       log_stats_interval=1e9)  # fmt: skip
    engine.add_beam_search({"prompt_token_ids": list(range(3, 30))}, BeamSearchParams(beam_width=3, max_tokens=40, ignore_eos=True))
    for i in range(3):
        engine.add_request({"prompt_token_ids": [5 + i] + PROMPT[:26]}, SamplingParams(max_tokens=60, ignore_eos=True))
    holders_seen = 0
    while engine.has_unfinished_requests():
        engine.step()
        state = kv_cache_state(engine)
        used = [b for b, c in enumerate(state["blocks"]) if c == "u"]
        assert all(state["owner"][b] >= 0 for b in used), "a block in use with no owner"
        rows = state["requests"]
        holders_seen += sum(r["queue"] == "beam" for r in rows)
        assert all(r["num_blocks"] > 0 for r in rows if r["queue"] == "beam")
    assert holders_seen > 0  # the case this test is about happened
