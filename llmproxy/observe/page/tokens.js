// The status page's Token latency panel: per model, from /metrics (the
// histograms of observe/tokenmetrics.py, every host of a model added up):
// streams, time to first token (from arrival, and the engine's part), the
// median gap between tokens, output and prompt tokens per second. Read at load
// and every REFRESH_MS while the page is visible. docs/observability.md says
// what each figure measures.
"use strict";

(function () {
  const REFRESH_MS = 5000;
  const PREFIX = "llmproxy_";
  const FIGURES = {
    ttft: "time_to_first_token_seconds",
    engine: "engine_time_to_first_token_seconds",
    gap: "inter_token_gap_seconds",
    output: "output_tokens_per_second",
    prompt: "prompt_tokens_per_second",
  };
  const BY_NAME = {};
  for (const [key, name] of Object.entries(FIGURES)) BY_NAME[PREFIX + name] = key;

  function labels(text) {
    const out = {};
    const re = /(\w+)="((?:[^"\\]|\\.)*)"/g;
    let m;
    while ((m = re.exec(text)) !== null) {
      out[m[1]] = m[2].replace(/\\n/g, "\n").replace(/\\(["\\])/g, "$1");
    }
    return out;
  }

  // model -> figure -> {sum, count, buckets: {le: cumulative}}
  function parse(text) {
    const models = {};
    for (const line of text.split("\n")) {
      const m = /^(\w+?)_(sum|count|bucket)\{([^}]*)\} (\S+)$/.exec(line);
      if (!m || !(m[1] in BY_NAME)) continue;
      const l = labels(m[3]);
      if (!l.model) continue;
      const model = (models[l.model] = models[l.model] || {});
      const fig = (model[BY_NAME[m[1]]] = model[BY_NAME[m[1]]] || { sum: 0, count: 0, buckets: {} });
      const value = Number(m[4]);
      if (m[2] === "bucket") fig.buckets[l.le] = (fig.buckets[l.le] || 0) + value;
      else fig[m[2]] += value;
    }
    return models;
  }

  const mean = (fig) => (fig && fig.count > 0 ? fig.sum / fig.count : null);

  // The upper bound of the bucket holding the median (cumulative buckets).
  function median(fig) {
    if (!fig || fig.count <= 0) return null;
    const buckets = Object.entries(fig.buckets).filter(([le]) => le !== "+Inf")
      .map(([le, n]) => [Number(le), n]).sort((a, b) => a[0] - b[0]);
    for (const [bound, n] of buckets) {
      if (n >= fig.count / 2) return bound;
    }
    return Infinity;
  }

  function seconds(v) {
    if (v === null) return "—";
    if (v === Infinity) return "> 5 s";
    return v < 1 ? Math.round(v * 1000) + " ms" : v.toFixed(2) + " s";
  }
  const rate = (v) => (v === null ? "—" : (v < 10 ? v.toFixed(1) : Math.round(v)) + " tok/s");

  function cell(text, cls) {
    const td = document.createElement("td");
    if (cls) td.className = cls;
    td.textContent = text;
    return td;
  }

  function render(models) {
    const body = document.querySelector("#tokens tbody");
    const empty = document.getElementById("tokens-empty");
    if (!body || !empty) return;
    const names = Object.keys(models).sort();
    body.replaceChildren();
    for (const name of names) {
      const f = models[name];
      const row = document.createElement("tr");
      row.dataset.model = name;
      const figures = {
        streams: f.ttft ? f.ttft.count : 0, ttft: mean(f.ttft), engine: mean(f.engine),
        gap: median(f.gap), output: mean(f.output), prompt: mean(f.prompt),
      };
      for (const [k, v] of Object.entries(figures)) {
        if (v !== null && isFinite(v)) row.dataset[k] = String(v);
      }
      row.append(cell(name, "mono"), cell(String(figures.streams), "num"),
        cell(seconds(figures.ttft), "num"), cell(seconds(figures.engine), "num"),
        cell(seconds(figures.gap), "num"), cell(rate(figures.output), "num"),
        cell(rate(figures.prompt), "num"));
      body.append(row);
    }
    empty.hidden = names.length > 0;
  }

  async function refresh() {
    try {
      // absolute: see app.js's own()
      const r = await fetch(location.origin + "/metrics", { cache: "no-store" });
      if (r.ok) render(parse(await r.text()));
    } catch (e) {
      // the page's connection state says when the proxy is away
    }
  }

  refresh();
  setInterval(() => { if (document.visibilityState === "visible") refresh(); }, REFRESH_MS);
  window.llmproxyTokens = { refresh, parse };
})();
