// The playground: chat with one of this proxy's models from its page, streamed.
// Plain JS, no dependencies, no build step; app.js knows it only by the
// "llmproxy:rendered" event it sends after each render.
//
// Contracts:
// - what a model or the proxy sends is shown as text (textContent), never parsed as HTML;
// - a key typed here lives in this script's memory (and its input field) only: never in
//   localStorage, sessionStorage, a cookie, IndexedDB or the URL; a reload forgets it;
// - without a typed key, the request carries what the browser sends this origin by itself:
//   the HTTP Basic credentials the page was opened with (an admin key), or nothing;
// - Stop aborts the fetch: the browser closes the connection and the proxy cancels the
//   engine's request, as for any client that leaves;
// - time to first token: from sending the request to the first SSE event with content;
//   tokens: the SSE events with content (or the engine's usage.completion_tokens when it
//   sends one); tokens per second: the tokens after the first over the time from the first
//   token to the last (the generation rate, without the wait for the first token).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const own = (path) => location.origin + path;   // absolute: see app.js's own()
  const P = {
    key: "",             // the key typed into the page (memory only)
    keyModels: null,     // /v1/models as that key sees it (null: use the page's list)
    messages: [],        // the conversation, sent whole with each request
    controller: null,    // the AbortController of the generation running, if any
  };

  // -- the model list ---------------------------------------------------------------------
  function pageState() {
    return (window.llmproxyPage && window.llmproxyPage.state) || {};
  }

  const models = () => P.keyModels || pageState().models || [];

  function describe(m) {
    const x = m.llmproxy || {};
    const parts = [m.id];
    if (x.alias_of) parts.push("→ " + x.alias_of);
    if (x.state) parts.push(x.state);
    if (x.host) parts.push("on " + x.host);
    if (x.available === false) parts.push("not listed by its host");
    return parts.join(" · ");
  }

  function renderModels() {
    const select = $("pg-model");
    const list = models();
    const chosen = select.value;
    const options = list.map((m) => {
      const o = document.createElement("option");
      o.value = String(m.id);
      o.textContent = describe(m);
      o.dataset.state = (m.llmproxy && m.llmproxy.state) || "";
      return o;
    });
    select.replaceChildren(...options);
    if (list.some((m) => String(m.id) === chosen)) select.value = chosen;
    renderChosen();
  }

  function renderChosen() {
    const m = models().find((x) => String(x.id) === $("pg-model").value);
    const state = (m && m.llmproxy && m.llmproxy.state) || "";
    const el = $("pg-model-state");
    el.textContent = m ? state || "—" : "no models";
    el.dataset.state = state;
    el.title = state === "loaded" ? "its engine runs: the answer starts at once"
      : state ? "the first request starts its engine: expect a wait" : "";
  }

  // -- whose key ------------------------------------------------------------------------------
  function renderAuth() {
    const access = (pageState().status || {}).access;
    // Keys off: no field for one (a key the proxy does not check would only confuse).
    $("pg-key-field").hidden = !!access && !access.keys;
    if (access && !access.keys && P.key) {
      $("pg-key").value = "";
      keyChanged();
      return;
    }
    let text;
    if (P.key) text = "the key typed here (kept in this page's memory only; a reload forgets it)";
    else if (!access) text = "…";
    else if (!access.keys) text = "keys are off: no key needed";
    else if (access.public_status) text = "this proxy needs a key for /v1: type one";
    else text = "the admin key this page was opened with (your browser sends it), unless you type another";
    $("pg-auth").textContent = text;
  }

  async function keyChanged() {
    P.key = $("pg-key").value.trim();
    P.keyModels = null;
    renderAuth();
    if (P.key) {
      try {
        const r = await fetch(own("/v1/models"), { cache: "no-store", credentials: "omit",
          headers: { Accept: "application/json", Authorization: "Bearer " + P.key } });
        if (!r.ok) throw new Error(await errorText(r));
        const doc = await r.json();
        if ($("pg-key").value.trim() === P.key) P.keyModels = Array.isArray(doc.data) ? doc.data : [];
        note("");
      } catch (err) {
        note("the key's models: " + String(err.message || err), "bad");
      }
    }
    renderModels();
  }

  // -- the conversation -------------------------------------------------------------------------
  function bubble(role, text) {
    const el = document.createElement("div");
    el.className = "pg-msg";
    el.dataset.role = role;
    const who = document.createElement("span");
    who.className = "pg-role";
    who.textContent = role === "user" ? "you" : role;
    const body = document.createElement("div");
    body.className = "pg-text";
    body.textContent = text;
    el.append(who, body);
    $("pg-log").append(el);
    el.scrollIntoView({ block: "nearest" });
    return el;
  }

  function note(text, tone) {
    const el = $("pg-note");
    el.textContent = text;
    el.dataset.tone = tone || "";
  }

  async function errorText(r) {
    let message = "HTTP " + r.status;
    try {
      const doc = await r.json();
      if (doc && doc.error && doc.error.message) message += ": " + String(doc.error.message);
    } catch (_) { /* not JSON: the status says it */ }
    return message;
  }

  // -- timings ----------------------------------------------------------------------------------
  function showStats(run) {
    const tokens = run.usageTokens !== null ? run.usageTokens : run.tokens;
    $("pg-ttft").textContent = run.first === null ? "—" : ((run.first - run.sent) / 1000).toFixed(2) + " s";
    $("pg-tokens").textContent = String(tokens);
    const span = run.first === null ? 0 : (run.last - run.first) / 1000;
    $("pg-rate").textContent = tokens > 1 && span > 0 ? ((tokens - 1) / span).toFixed(1) + " tokens/s" : "—";
    $("pg-outcome").textContent = run.outcome;
    $("pg-outcome").dataset.outcome = run.outcome;
  }

  // -- SSE: split on blank lines, join each event's data: lines ---------------------------------
  function takeEvents(buffer) {
    // A trailing "\r" may be the first half of "\r\n": keep it for the next chunk.
    const cut = buffer.endsWith("\r") ? buffer.length - 1 : buffer.length;
    const parts = buffer.slice(0, cut).replace(/\r\n?/g, "\n").split("\n\n");
    const rest = parts.pop() + buffer.slice(cut);
    const events = parts.map((block) => block.split("\n")
      .filter((line) => line.startsWith("data:"))
      .map((line) => line.slice(line.startsWith("data: ") ? 6 : 5))
      .join("\n")).filter((data) => data !== "");
    return { events, rest };
  }

  // One chunk of the stream into the run; true at [DONE].
  function apply(run, data, out) {
    if (data === "[DONE]") return true;
    let chunk;
    try {
      chunk = JSON.parse(data);
    } catch (_) {
      return false;       // not JSON (a comment, a keep-alive): nothing to show
    }
    if (chunk && chunk.error) throw new Error(String(chunk.error.message || "the engine failed"));
    const choice = chunk && Array.isArray(chunk.choices) ? chunk.choices[0] : null;
    const delta = (choice && choice.delta) || {};
    for (const [field, el] of [["reasoning_content", out.thinking], ["content", out.text]]) {
      const piece = delta[field];
      if (typeof piece !== "string" || piece === "") continue;
      const now = performance.now();
      if (run.first === null) run.first = now;
      run.last = now;
      run.tokens += 1;
      el.append(piece);       // a text node: never markup
      if (field === "content") run.answer += piece;
    }
    if (chunk && chunk.usage && typeof chunk.usage.completion_tokens === "number") {
      run.usageTokens = chunk.usage.completion_tokens;
    }
    return false;
  }

  async function send() {
    const input = $("pg-input");
    const text = input.value.trim();
    const model = $("pg-model").value;
    if (P.controller || !text) return;
    if (!model) {
      note("pick a model first", "bad");
      return;
    }
    note("");
    P.messages.push({ role: "user", content: text });
    bubble("user", text);
    input.value = "";
    const el = bubble("assistant", "");
    el.dataset.state = "waiting";
    const out = { text: el.querySelector(".pg-text"), thinking: document.createElement("div") };
    out.thinking.className = "pg-thinking";
    out.text.before(out.thinking);
    const run = { sent: performance.now(), first: null, last: null, tokens: 0, usageTokens: null,
      answer: "", outcome: "waiting" };
    const controller = new AbortController();
    P.controller = controller;
    busy(true);
    showStats(run);
    const headers = { "Content-Type": "application/json", Accept: "text/event-stream" };
    if (P.key) headers.Authorization = "Bearer " + P.key;
    try {
      const r = await fetch(own("/v1/chat/completions"), {
        method: "POST", headers, cache: "no-store", signal: controller.signal,
        credentials: P.key ? "omit" : "same-origin",
        body: JSON.stringify({ model, stream: true, stream_options: { include_usage: true },
          messages: P.messages }),
      });
      el.dataset.requestId = r.headers.get("x-request-id") || "";
      if (!r.ok) {
        const why = await errorText(r);
        throw new Error(r.status === 401 ? why + " (type a key above)" : why);
      }
      run.outcome = "streaming";
      el.dataset.state = "streaming";
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      let done = false;
      for (;;) {     // read to the body's end, so that the connection is kept for the next
        const { value, done: closed } = await reader.read();
        if (closed) break;
        const taken = takeEvents(buffer + decoder.decode(value, { stream: true }));
        buffer = taken.rest;
        for (const data of taken.events) {
          if (!done && apply(run, data, out)) done = true;
        }
        showStats(run);
      }
      if (done) {
        run.outcome = "done";
      } else {
        run.outcome = "cut";
        note("the stream ended without [DONE]: the answer may be incomplete", "bad");
      }
    } catch (err) {
      if (err && err.name === "AbortError") {
        run.outcome = "stopped";
      } else {
        run.outcome = "failed";
        note(String(err.message || err), "bad");
      }
    } finally {
      el.dataset.state = run.outcome;
      if (run.answer) P.messages.push({ role: "assistant", content: run.answer });
      else if (run.outcome === "failed") P.messages.pop();   // the question goes again, not twice
      P.controller = null;
      busy(false);
      showStats(run);
    }
  }

  function busy(on) {
    $("pg-send").disabled = on;
    $("pg-stop").disabled = !on;
  }

  function stop() {
    if (P.controller) P.controller.abort();
  }

  function clear() {
    stop();
    P.messages = [];
    $("pg-log").replaceChildren();
    note("");
  }

  // -- start ------------------------------------------------------------------------------------------
  $("pg-model").addEventListener("change", renderChosen);
  $("pg-key").addEventListener("change", keyChanged);
  $("pg-send").addEventListener("click", send);
  $("pg-stop").addEventListener("click", stop);
  $("pg-clear").addEventListener("click", clear);
  $("pg-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      send();
    }
  });
  // The page renders on every event: the list is rebuilt only when another list was read
  // (rebuilding it would close it under the operator's pointer).
  let listed = null;
  document.addEventListener("llmproxy:rendered", () => {
    if (models() !== listed) {
      listed = models();
      renderModels();
    }
    renderAuth();
  });
  busy(false);
  renderModels();
  renderAuth();
})();
