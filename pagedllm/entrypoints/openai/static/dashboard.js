// The KV-cache dashboard: polls GET /v1/kv_cache/state and draws it. No dependencies.
"use strict";
(function () {
  const POLL_MS = 500;
  const CELL = 12; // px per block, gap included
  const $ = (id) => document.getElementById(id);
  let state = null;
  let key = sessionStorage.getItem("pagedllm-key") || "";
  const m = location.hash.match(/key=([^&]+)/);
  if (m) { key = decodeURIComponent(m[1]); sessionStorage.setItem("pagedllm-key", key); }

  function color(i) { // a stable color per request index
    const hue = (i * 137.508) % 360;
    return `hsl(${hue.toFixed(0)}, 62%, 52%)`;
  }

  function drawGrid(s) {
    const canvas = $("grid");
    const perRow = Math.max(1, Math.floor((canvas.parentElement.clientWidth - 2) / CELL));
    const rows = Math.ceil(s.num_blocks / perRow);
    canvas.width = perRow * CELL;
    canvas.height = Math.max(1, rows) * CELL;
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const shared = new Set(s.shared);
    for (let b = 0; b < s.num_blocks; b++) {
      const x = (b % perRow) * CELL, y = Math.floor(b / perRow) * CELL;
      const st = s.blocks[b];
      ctx.fillStyle = st === "u" ? (s.owner[b] >= 0 ? color(s.owner[b]) : "#666") : st === "c" ? "#b9c0cc" : "#eef0f4";
      ctx.fillRect(x, y, CELL - 2, CELL - 2);
      if (shared.has(b)) {
        ctx.strokeStyle = "#111";
        ctx.lineWidth = 2;
        ctx.strokeRect(x + 1, y + 1, CELL - 4, CELL - 4);
      }
    }
    canvas.dataset.perRow = perRow;
  }

  function drawRequests(s) {
    const body = $("requests").tBodies[0];
    body.innerHTML = "";
    s.requests.forEach((r, i) => {
      const tr = document.createElement("tr");
      tr.className = "req " + r.queue;
      tr.dataset.requestId = r.request_id;
      const pct = r.num_tokens ? (100 * r.num_computed_tokens / r.num_tokens) : 0;
      const cells = [
        `<i class="sw" style="background:${r.queue === "running" ? color(i) : "#fff"}"></i>`,
        r.request_id, r.queue,
        `<span class="tokens">${r.num_computed_tokens} / ${r.num_tokens}</span>`,
        `<span class="bar"><i style="width:${pct.toFixed(1)}%"></i></span>`,
        `${r.num_output_tokens}`, `${r.num_blocks}`, `${r.num_preemptions}`,
      ];
      tr.innerHTML = cells.map((c) => `<td>${c}</td>`).join("");
      body.appendChild(tr);
    });
  }

  function drawChart(id, series, lines, maxFixed) {
    const canvas = $(id), ctx = canvas.getContext("2d");
    const W = canvas.width, H = canvas.height, pad = 28;
    ctx.clearRect(0, 0, W, H);
    let max = maxFixed || 1;
    if (!maxFixed) for (const p of series) for (const l of lines) max = Math.max(max, p[l.key] || 0);
    ctx.strokeStyle = "#dde"; ctx.fillStyle = "#667"; ctx.font = "10px sans-serif";
    ctx.beginPath(); ctx.moveTo(pad, 4); ctx.lineTo(pad, H - 14); ctx.lineTo(W - 4, H - 14); ctx.stroke();
    ctx.fillText(maxFixed ? "100%" : max.toFixed(0), 2, 12);
    ctx.fillText("-" + (series.length ? -series[0].t : 0) + " s", pad, H - 2);
    ctx.fillText("now", W - 24, H - 2);
    for (const l of lines) {
      ctx.strokeStyle = l.color; ctx.lineWidth = 1.5; ctx.beginPath();
      let started = false;
      series.forEach((p, i) => {
        const v = p[l.key];
        if (v === null || v === undefined) { started = false; return; }
        const x = pad + (W - pad - 4) * i / Math.max(1, series.length - 1);
        const y = (H - 14) - (H - 20) * v / max;
        if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
      });
      ctx.stroke();
    }
  }

  function render(s) {
    state = s;
    $("used-count").textContent = s.num_used_blocks;
    $("cached-count").textContent = s.num_cached_free_blocks;
    $("free-count").textContent = s.num_free_blocks;
    $("total-count").textContent = s.num_blocks;
    $("shared-count").textContent = s.shared.length;
    $("running-count").textContent = s.num_running;
    $("waiting-count").textContent = s.num_waiting;
    $("preemptions").textContent = s.num_preemptions_total;
    const series = (s.recent && s.recent.series) || [];
    const last = series.length ? series[series.length - 1] : null;
    $("tps").textContent = last ? last.generation_tps.toFixed(1) : "-";
    const hr = s.recent ? s.recent.prefix_hit_rate_total : null;
    $("hit-rate").textContent = hr === null || hr === undefined ? "-" : (100 * hr).toFixed(1) + "%";
    $("status").textContent = "updated " + new Date(s.time * 1000).toLocaleTimeString();
    drawGrid(s);
    drawRequests(s);
    drawChart("chart-tps", series, [{ key: "generation_tps", color: "#3b7dd8" }, { key: "prompt_tps", color: "#e8883a" }]);
    drawChart("chart-hits", series, [{ key: "prefix_hit_rate", color: "#54a24b" }], 1);
  }

  // /dashboard?engine=r shows data-parallel replica r's pool (the state route's own parameter).
  const engine = new URLSearchParams(location.search).get("engine");
  const stateUrl = "/v1/kv_cache/state" + (engine === null ? "" : "?engine=" + encodeURIComponent(engine));

  async function poll() {
    try {
      const headers = key ? { Authorization: "Bearer " + key } : {};
      const r = await fetch(stateUrl, { headers });
      if (r.status === 401) {
        $("keyform").style.display = "block";
        $("error").textContent = "this server needs an API key";
      } else if (!r.ok) {
        $("error").textContent = "HTTP " + r.status;
      } else {
        $("error").textContent = "";
        $("keyform").style.display = "none";
        render(await r.json());
      }
    } catch (e) {
      $("error").textContent = "server unreachable";
    }
    setTimeout(poll, POLL_MS);
  }

  $("keyform").addEventListener("submit", (e) => {
    e.preventDefault();
    key = $("key").value;
    sessionStorage.setItem("pagedllm-key", key);
  });

  $("grid").addEventListener("mousemove", (e) => {
    const tip = $("tip");
    if (!state) return;
    const canvas = $("grid"), rect = canvas.getBoundingClientRect();
    const perRow = +canvas.dataset.perRow;
    const b = Math.floor((e.clientY - rect.top) / CELL) * perRow + Math.floor((e.clientX - rect.left) / CELL);
    if (b < 0 || b >= state.num_blocks) { tip.style.display = "none"; return; }
    const st = { f: "free", c: "free, cached prefix", u: "in use" }[state.blocks[b]];
    const owner = state.owner[b] >= 0 ? " by " + state.requests[state.owner[b]].request_id : "";
    tip.textContent = `block ${b}: ${st}${owner}${state.shared.includes(b) ? " (shared)" : ""}`;
    tip.style.left = e.clientX + 12 + "px";
    tip.style.top = e.clientY + 12 + "px";
    tip.style.display = "block";
  });
  $("grid").addEventListener("mouseleave", () => { $("tip").style.display = "none"; });

  poll();
})();
