// The dashboard: reads /v1/stats/stream (one snapshot a second, with the rates since the
// last) and draws the last minutes as small SVG line charts; tables show the totals.
"use strict";

(() => {
  const $ = mlx.$;
  const POINTS = 180; // three minutes at one snapshot a second
  const series = { tps: [], running: [], waiting: [], prefix: [], prefixNow: [], vision: [], visionNow: [] };
  let last = null; // the last snapshot, for the models table

  function push(name, value) {
    const s = series[name];
    s.push(value === undefined ? null : value);
    if (s.length > POINTS) s.shift();
  }

  // ---- charts ----
  // lines: [{values, cls, dots}]: a null value is a gap; `dots` draws each value as a dot
  // (hit rates of one second, which exist only in the seconds that looked something up).
  function chart(svg, lines, fixedMax) {
    // Drawn in the element's own pixels (0 while its tab is hidden: the next second redraws).
    const W = svg.clientWidth || 300, H = svg.clientHeight || 70, TOP = 12;
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const all = lines.flatMap((l) => l.values).filter((v) => v !== null);
    const max = fixedMax || Math.max(1, ...all) * 1.1;
    const x = (i) => (W * i) / (POINTS - 1);
    const y = (v) => H - ((H - TOP) * v) / max;
    const parts = [`<line class="axis" x1="0" y1="${H}" x2="${W}" y2="${H}"/>`,
      `<text x="2" y="9">${fixedMax ? "100%" : mlx.num(max, max < 10 ? 1 : 0)}</text>`];
    for (const l of lines) {
      const offset = POINTS - l.values.length; // newest on the right
      if (l.dots) {
        l.values.forEach((v, i) => {
          if (v !== null) parts.push(`<circle class="${l.cls}" cx="${x(i + offset)}" cy="${y(v)}" r="2"/>`);
        });
        continue;
      }
      let run = [];
      const flush = () => {
        if (run.length) parts.push(`<polyline class="${l.cls}" points="${run.join(" ")}"/>`);
        run = [];
      };
      l.values.forEach((v, i) => (v === null ? flush() : run.push(`${x(i + offset)},${y(v)}`)));
      flush();
    }
    svg.innerHTML = parts.join("");
  }

  // ---- tables ----
  function table(id, rows) {
    $(id).replaceChildren(...rows.map(([key, label, value]) => {
      const tr = document.createElement("tr");
      tr.dataset.key = key;
      const th = document.createElement("th");
      th.textContent = label;
      const td = document.createElement("td");
      td.textContent = value;
      tr.append(th, td);
      return tr;
    }));
  }

  const seconds = (s) => (s === null || s === undefined ? "–" : s.toFixed(s < 1 ? 3 : 2) + " s");

  function showModels() {
    const rows = mlx.models.map((m) => {
      // A server with several models says each one's state; a single-model server does
      // not, and its one model is as well as the engine that runs it.
      let state = m.state;
      if (!state && last && m.id === last.model) state = last.status === "ok" ? "serving" : last.status;
      const len = m.max_model_len ? ` · ${m.max_model_len} tokens` : "";
      return [m.id, m.id, (state || "–") + len];
    });
    table("t-models", rows.length ? rows : [["none", "–", "no models listed"]]);
  }

  function show(snap) {
    last = snap;
    const r = snap.rates || {}, e = snap.engine, q = snap.requests, m = snap.memory;
    const caches = snap.caches || {};
    const pc = caches.prefix_cache || {}, vc = caches.vision_cache;
    const visionLooked = vc ? vc.hits + vc.misses : 0;
    const visionRate = visionLooked ? vc.hits / visionLooked : null;

    push("tps", r.generation_tokens_per_s);
    push("running", e.running);
    push("waiting", e.waiting);
    push("prefix", pc.queried_tokens ? pc.hit_rate : null);
    push("prefixNow", r.prefix_hit_rate);
    push("vision", visionRate);
    push("visionNow", r.vision_hit_rate);

    $("d-tps").textContent = mlx.num(r.generation_tokens_per_s, 1);
    $("d-running").textContent = e.running;
    $("d-waiting").textContent = e.waiting;
    $("d-prefix").textContent = pc.enabled === false ? "off" : mlx.pct(pc.queried_tokens ? pc.hit_rate : null);
    $("d-vision").textContent = !vc ? "no vision tower" : vc.enabled === false ? "off" : mlx.pct(visionRate);
    chart($("c-tps"), [{ values: series.tps, cls: "s1" }]);
    chart($("c-reqs"), [{ values: series.running, cls: "s1" }, { values: series.waiting, cls: "s2" }]);
    chart($("c-prefix"), [{ values: series.prefix, cls: "s1" }, { values: series.prefixNow, cls: "s2", dots: true }], 1);
    chart($("c-vision"), [{ values: series.vision, cls: "s1" }, { values: series.visionNow, cls: "s2", dots: true }], 1);

    const finished = Object.entries(q.finished).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
    const statuses = Object.entries(q.http_statuses).map(([k, v]) => `${k}: ${v}`).join(", ") || "none";
    table("t-totals", [
      ["finished", "Requests finished", finished],
      ["prompt_tokens", "Prompt tokens", q.prompt_tokens],
      ["cached_prompt_tokens", "…from the prefix cache", q.cached_prompt_tokens],
      ["generation_tokens", "Generated tokens", q.generation_tokens],
      ["mean_ttft", "Mean time to first token", seconds(q.mean_ttft_s)],
      ["mean_e2e", "Mean request time", seconds(q.mean_e2e_s)],
      ["http", "HTTP responses", statuses],
      ["steps", "Engine steps", e.steps],
      ["slots", "Batch slots", e.max_num_seqs],
    ]);

    const misses = Object.entries(pc.misses || {}).map(([k, v]) => [k, k.replace(/_/g, " "), v]);
    table("t-misses", pc.enabled === false ? [["off", "prefix cache", "off"]] : [
      ["queries", "Lookups", mlx.num(pc.queries)],
      ["hits", "Hits (full or partial)", mlx.num(pc.hits)],
      ...(misses.length ? misses : [["none", "Misses", "none"]]),
      ["evictions", "Blocks evicted", mlx.num(pc.evictions)],
    ]);

    const disk = pc.disk;
    const of = (used, budget) => `${mlx.bytes(used)}${budget ? " of " + mlx.bytes(budget) : ""}`;
    table("t-memory", [
      ["mlx_active", "MLX arrays", mlx.bytes(m.mlx_active_bytes)],
      ["mlx_peak", "MLX peak", mlx.bytes(m.mlx_peak_bytes)],
      ["mlx_cache", "MLX buffer cache", mlx.bytes(m.mlx_cache_bytes)],
      ["rss", "Process resident", mlx.bytes(m.process_rss_bytes)],
      ["prefix", "Prefix cache", pc.enabled === false ? "off" : of(m.prefix_cache_bytes, m.prefix_cache_budget_bytes)],
      ...(vc ? [["vision", "Vision cache", of(m.vision_cache_bytes, m.vision_cache_budget_bytes)]] : []),
      ["disk", "Disk tier", disk ? `${of(disk.bytes, disk.budget)}, ${disk.blocks} blocks` : "off"],
    ]);
    showModels();

    const when = new Date(snap.time * 1000).toLocaleTimeString();
    const why = snap.reason ? ` (${snap.reason})` : "";
    const stale = snap.caches ? "" : " · cache stats unavailable";
    $("dash-status").textContent = `${snap.model} · ${snap.status}${why} · updated ${when}${stale}`;
    $("dash-status").className = "status " + snap.status;
  }

  // ---- the stream ----
  const keyChanged = () => new Promise((resolve) => window.addEventListener("mlx-key", resolve, { once: true }));
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

  async function follow() {
    for (;;) {
      try {
        const res = await mlx.api("v1/stats/stream");
        if (res.status === 401) {
          $("dash-status").textContent = "The dashboard needs the API key (button at the top).";
          await keyChanged();
          continue;
        }
        if (!res.ok) throw new Error(await mlx.errorText(res));
        for await (const ev of mlx.sse(res)) show(JSON.parse(ev.data));
        $("dash-status").textContent = "The server ended the stream; reconnecting…";
      } catch (e) {
        $("dash-status").textContent = `Disconnected (${e.message || e}); reconnecting…`;
      }
      $("dash-status").className = "status dead";
      await sleep(2000);
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    mlx.onModels(showModels);
    follow(); // from page load, so the charts hold the chat's requests too
  });
})();
