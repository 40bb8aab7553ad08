// The Captures panel (capture on in the config: GET /api/captures): the newest
// captured requests, one shown with its redacted heads and bodies, and replayed to
// a model of /v1/models with both answers side by side and their timings. Its own
// file under the page's CSP (no inline script); app.js only tells it, by the
// document event "llmproxy:request-end", that a request ended. Every text from
// the proxy is set as text (textContent), never as markup.
(() => {
  "use strict";
  const PAGE = 20;
  const RELOAD_AFTER_MS = 800;        // a burst of ended requests: one read

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") e.textContent = v; else e.setAttribute(k, v);
    }
    for (const c of children) if (c) e.append(c);
    return e;
  }

  const secs = (v) => typeof v === "number" ? v.toFixed(3) + "s" : "—";
  const count = el("span", { id: "captures-count", class: "count" });
  const note = el("p", { id: "captures-note", class: "empty", text: "loading…" });
  const body = el("tbody");
  const table = el("table", { id: "captures", class: "table", hidden: "" },
    el("thead", {}, el("tr", {}, ...["Request", "Time", "Model", "Host", "Key", "Status",
      "TTFB", "Took", "Bytes"].map((h, i) => el("th", { class: i > 5 ? "num" : "", text: h })))),
    body);
  const detail = el("div", { id: "capture-detail", class: "capture-detail", hidden: "" });
  const panel = el("section", { id: "captures-panel", class: "panel", "aria-labelledby": "h-captures" },
    el("h2", { id: "h-captures" }, "Captures ", count),
    el("div", { class: "table-wrap" }, table), note, detail);
  (document.querySelector(".col-main") || document.querySelector("main")).append(panel);

  let shown = null;      // the capture open in the detail, as read

  async function load() {
    let r;
    try {
      // absolute URLs throughout: see app.js's own()
      r = await fetch(location.origin + "/api/captures?limit=" + PAGE, { cache: "no-store" });
    } catch (err) {
      return say("The captures could not be read: " + (err.message || err));
    }
    if (r.status === 401 || r.status === 403) {
      return say("Captures are for the operator: a trusted peer, or an admin key.");
    }
    if (!r.ok) return say("The captures could not be read: HTTP " + r.status);
    const doc = await r.json();
    if (!doc.enabled) return say("Capture is off: add a \"capture\" block to the config.");
    count.textContent = `${doc.count} kept · ${Math.round(doc.bytes / 1024)} of `
      + `${Math.round(doc.max_bytes / 1024)} KiB`;
    body.replaceChildren(...doc.captures.map(row));
    table.hidden = !doc.captures.length;
    say(doc.captures.length ? "" : "No captures yet.");
  }

  function say(text) {
    note.textContent = text;
    note.hidden = !text;
    if (text) table.hidden = !body.children.length || note.textContent.startsWith("Capture");
  }

  function row(c) {
    const tone = c.outcome !== "completed" || (c.status || 0) >= 400 ? "bad" : "ok";
    const tr = el("tr", { "data-id": c.id, tabindex: "0", class: "capture-row" },
      el("td", { class: "mono id", text: c.id }),
      el("td", { class: "mono", text: new Date(c.time * 1000).toLocaleTimeString() }),
      el("td", { text: c.model || "—" }), el("td", { text: c.host || "—" }),
      el("td", { text: c.key || "—" }),
      el("td", {}, el("span", { class: "pill " + tone, text: `${c.status ?? "—"} ${c.outcome}` })),
      el("td", { class: "num mono", text: secs(c.ttfb) }),
      el("td", { class: "num mono", text: secs(c.duration) }),
      el("td", { class: "num mono", text: String(c.response_bytes) }));
    tr.addEventListener("click", () => open(c.id));
    tr.addEventListener("keydown", (e) => { if (e.key === "Enter") open(c.id); });
    return tr;
  }

  function heads(part) {
    const lines = Object.entries(part.headers || {}).flatMap(([n, vs]) => vs.map((v) => `${n}: ${v}`));
    const text = part.body === null ? "(bodies are not captured)" : part.body;
    return lines.join("\n") + "\n\n" + text + (part.truncated ? "\n… (cut)" : "");
  }

  async function open(id) {
    const r = await fetch(location.origin + "/api/captures/" + encodeURIComponent(id), { cache: "no-store" });
    if (!r.ok) {
      detail.replaceChildren(el("p", { class: "empty", text: `${id}: HTTP ${r.status} (let go?)` }));
      detail.hidden = false;
      return;
    }
    shown = await r.json();
    const models = el("select", { id: "replay-model", "aria-label": "replay to model" });
    const go = el("button", { id: "replay-go", type: "button", text: "Replay" });
    go.addEventListener("click", () => replay(models.value));
    detail.replaceChildren(
      el("h3", { text: `${shown.id} · ${shown.method} ${shown.path} · ${shown.model || "—"} on `
        + `${shown.host || "—"} · ${shown.status ?? "—"} ${shown.outcome}` }),
      el("div", { class: "capture-sides" },
        el("div", {}, el("h4", { text: "Request" }),
          el("pre", { id: "capture-request", class: "capture-text", text: heads(shown.request) })),
        el("div", {}, el("h4", { text: "Answer" }),
          el("pre", { id: "capture-answer", class: "capture-text", text: heads(shown.response) }))),
      el("div", { class: "capture-replay" }, "Replay to ", models, " ", go),
      el("div", { id: "replay-result", class: "capture-sides", hidden: "" }));
    detail.hidden = false;
    try {
      const list = await (await fetch(location.origin + "/v1/models", { cache: "no-store" })).json();
      for (const m of list.data || []) models.append(el("option", { value: m.id, text: m.id }));
      models.value = shown.model || "";
    } catch (err) { /* no list: the captured model alone */ }
    if (!models.options.length && shown.model) models.append(el("option", { value: shown.model, text: shown.model }));
  }

  // What the model said: a stream's deltas joined, else the message, else the body.
  function answerText(text) {
    const pieces = [];
    for (const line of (text || "").split("\n")) {
      const data = line.startsWith("data:") ? line.slice(5).trim() : "";
      if (!data || data === "[DONE]") continue;
      try {
        for (const c of JSON.parse(data).choices || []) pieces.push((c.delta || {}).content || c.text || "");
      } catch (err) { /* not an event of JSON */ }
    }
    if (pieces.length) return pieces.join("");
    try {
      const c = JSON.parse(text).choices[0];
      return (c.message || {}).content || c.text || "";
    } catch (err) { return text || ""; }
  }

  function column(title, facts, text, id) {
    return el("div", { id },
      el("h4", { text: title }), el("p", { class: "mono capture-facts", text: facts }),
      el("pre", { class: "capture-text", text }));
  }

  async function replay(model) {
    const result = document.getElementById("replay-result");
    const captured = shown;
    let doc;
    try {
      doc = JSON.parse(captured.request.body);
    } catch (err) {
      result.replaceChildren(el("p", { class: "empty", text: "This capture holds no JSON body to send again." }));
      result.hidden = false;
      return;
    }
    if (model) doc.model = model;
    const started = performance.now();
    const r = await fetch(location.origin + captured.path, { method: "POST", body: JSON.stringify(doc),
      headers: { "Content-Type": "application/json" } });
    const reader = r.body.getReader();
    const chunks = [];
    let ttfb = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      if (ttfb === null) ttfb = (performance.now() - started) / 1000;
      chunks.push(value);
    }
    const took = (performance.now() - started) / 1000;
    const text = await new Blob(chunks).text();
    const id = r.headers.get("x-request-id") || "";
    let host = "—";
    for (let i = 0; i < 5 && id; i++) {     // a large capture is kept a moment later
      try {
        const again = await fetch(location.origin + "/api/captures/" + encodeURIComponent(id), { cache: "no-store" });
        if (again.ok) { host = (await again.json()).host || "—"; break; }
      } catch (err) { /* its host stays unknown */ }
      await new Promise((done) => setTimeout(done, 200));
    }
    result.replaceChildren(
      column(`captured ${captured.id}`, `${captured.model || "—"} on ${captured.host || "—"} · `
        + `${captured.status} · ttfb ${secs(captured.ttfb)} · took ${secs(captured.duration)}`,
        answerText(captured.response.body), "replay-captured"),
      column(`replayed ${id}`, `${doc.model} on ${host} · ${r.status} · ttfb ${secs(ttfb)} · `
        + `took ${secs(took)}`, answerText(text), "replay-replayed"));
    result.hidden = false;
  }

  let pending = null;
  document.addEventListener("llmproxy:request-end", () => {
    if (pending === null) pending = setTimeout(() => { pending = null; load(); }, RELOAD_AFTER_MS);
  });
  window.llmproxyCaptures = { load, open };
  load();
})();
