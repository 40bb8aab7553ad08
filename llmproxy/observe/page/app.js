// llmproxy's status page: a snapshot from /status and /v1/models, kept live by
// the events of /api/events. Plain JS, no dependencies, no build step.
//
// The model: /status and /v1/models are read at load and re-read (debounced)
// when an event says something changed; the requests in flight follow
// request.start / request.end directly. Ages and countdowns tick here, every
// second, from local anchors (Date.now() at the moment a value was true).
"use strict";

(() => {
  const MAX_EVENTS = 50;          // shown in the events list
  const BACKFILL_SPAN = 900;      // event ids asked for at load (the server keeps 1,000)
  const IDS_PER_GENERATION = 1e9; // a generation's event ids start at generation * 1e9
  const POLL_BUSY_MS = 3000;      // /status re-read while requests are in flight (bytes, events)
  const POLL_IDLE_MS = 30000;     // and otherwise
  const POLL_WATCHED_MS = 10000;  // at most, while a host is watched: its GPUs and watch are no events
  const POLL_REFUSED_MS = 3000;   // and while the proxy refuses this page a live stream
  const EVENT_TYPES = ["request.start", "request.end", "roster", "engine.switch",
    "engine.idle_stop", "ready", "reload", "upgrade", "stop", "reset",
    "queue.reject", "host.cordon", "replica.failover", "route.fallback", "engine.command", "engine.exit",
    "engine.unhealthy", ...((window.llmproxySleep || {}).eventTypes || [])];
  const TAIL_SHOWN = 5;           // log lines shown for a restarting or failed engine

  const S = {
    status: null,          // the last /status document
    statusAt: 0,           // Date.now() when it was read
    statusError: null,     // why the last read failed
    models: null,          // the last /v1/models data
    offset: null,          // local clock - proxy clock, in seconds (an upper bound, refined)
    inflight: new Map(),   // request id -> row
    ended: new Map(),      // request id -> Date.now() when its request.end came
    events: [],            // listed events, newest first
    exits: new Map(),      // "host engine" -> the last engine.exit event (its log_tail)
    seen: new Set(),       // event ids already handled
    snapshotEventId: 0,    // the last event id the current /status snapshot includes
    es: null,
    conn: "connecting",    // live, reconnecting, polling (the stream refused), connecting
    refused: null,         // the proxy's reason for refusing the stream, while polling
    broken: false,         // the stream failed since it was last open
    needsBackfill: true,   // the next open should backfill the events list
    retryMs: 1000,
  };

  // -- small DOM helpers ------------------------------------------------------
  const $ = (id) => document.getElementById(id);
  // The proxy's own URL of a path, absolute: a page opened as http://user:KEY@host/ keeps the
  // credentials in its base URL, and fetch refuses a relative URL that resolves with them
  // (the browser still sends them to this origin by itself).
  const own = (path) => location.origin + path;

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else el.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat(Infinity)) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : String(c));
    }
    return el;
  }

  const mono = (text, cls) => h("span", { class: "mono" + (cls ? " " + cls : "") }, text);
  const badge = (text, tone, title) => h("span", { class: "badge " + (tone || ""), title }, text);
  const muted = (text) => h("span", { class: "muted" }, text);

  function replace(el, ...children) {
    el.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
  }

  // -- formatting ---------------------------------------------------------------
  function fmtAge(s, fine) {
    if (s === null || s === undefined || !isFinite(s)) return "—";
    s = Math.max(0, s);
    if (s < 10 && fine) return s.toFixed(1) + "s";
    if (s < 60) return Math.floor(s) + "s";
    const m = Math.floor(s / 60);
    if (m < 60) return m + "m " + String(Math.floor(s % 60)).padStart(2, "0") + "s";
    const hr = Math.floor(m / 60);
    if (hr < 24) return hr + "h " + String(m % 60).padStart(2, "0") + "m";
    return Math.floor(hr / 24) + "d " + (hr % 24) + "h";
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "—";
    if (n < 1024) return n + " B";
    if (n < 1024 * 1024) return (n / 1024).toFixed(1) + " KiB";
    return (n / 1024 / 1024).toFixed(1) + " MiB";
  }

  function fmtClock(t) {  // proxy clock seconds -> HH:MM:SS in the browser's zone
    if (typeof t !== "number") return "—";
    return new Date(t * 1000).toTimeString().slice(0, 8);
  }

  const fmtSeconds = (s) => (typeof s === "number" ? s.toFixed(s < 10 ? 2 : 1) + "s" : "—");
  const plural = (n, word) => n + " " + word + (n === 1 ? "" : "s");

  // A span whose text the ticker keeps current: the time since `ms` (local);
  // `fine`: tenths of a second below 10 s (a request's age).
  function since(ms, suffix, fine) {
    const el = h("span", { class: "tick", "data-since": Math.round(ms), "data-suffix": suffix || "",
      "data-fine": fine ? "1" : null });
    el.textContent = sinceText(el, Date.now());
    return el;
  }

  function sinceText(el, now) {
    return fmtAge((now - Number(el.dataset.since)) / 1000, !!el.dataset.fine) + (el.dataset.suffix || "");
  }

  // The time until `ms` (local), "due" when past.
  function until(ms) {
    const el = h("span", { class: "tick", "data-until": Math.round(ms) });
    el.textContent = untilText(ms, Date.now());
    return el;
  }

  function untilText(ms, now) {
    const s = (ms - now) / 1000;
    return s > 0 ? "in " + fmtAge(s) : "due";
  }

  // -- the proxy's clock ------------------------------------------------------------
  // offset = local - proxy. Each observation is an upper bound (a message is
  // received after it was made), so the smallest one seen is the best.
  function noteOffset(candidate) {
    if (!isFinite(candidate)) return;
    if (S.offset === null || candidate < S.offset) S.offset = candidate;
  }

  const localMs = (proxySeconds) => (proxySeconds + (S.offset || 0)) * 1000;

  // -- reading the snapshot -----------------------------------------------------------
  async function getJSON(path) {
    const r = await fetch(own(path), { cache: "no-store", headers: { Accept: "application/json" } });
    if (!r.ok) throw new Error(path + ": HTTP " + r.status);
    const at = Date.now();
    const date = Date.parse(r.headers.get("date") || "");
    return { doc: await r.json(), at, date };
  }

  let statusAsked = 0;     // reads started, and the latest one applied: an older
  let statusApplied = 0;   // answer that arrives late never replaces a newer one

  async function loadStatus() {
    const seq = ++statusAsked;
    try {
      const { doc, at, date } = await getJSON("/status");
      if (seq < statusApplied) return;
      statusApplied = seq;
      if (!isNaN(date)) noteOffset(at / 1000 - date / 1000);
      applyStatus(doc, at);
      S.statusError = null;
    } catch (err) {
      S.statusError = String(err.message || err);
    }
    dirty("all");
  }

  async function loadModels() {
    try {
      const { doc } = await getJSON("/v1/models");
      S.models = Array.isArray(doc.data) ? doc.data : [];
    } catch (err) {
      S.statusError = String(err.message || err);
    }
    dirty("models");
  }

  function applyStatus(doc, at) {
    const previous = S.status;
    if (previous && previous.pid !== doc.pid) {
      // Another process answers now (an upgrade, a restart): its event ids
      // are not comparable with what we kept; its snapshot is the truth.
      S.ended.clear();
      S.seen.clear();
      for (const row of S.inflight.values()) row.startEvent = null;
    }
    S.status = doc;
    S.statusAt = at;
    S.snapshotEventId = doc.last_event_id || 0;
    const snap = new Map();
    for (const r of doc.in_flight || []) if (r.model !== null && r.model !== undefined) snap.set(r.id, r);
    for (const [id, row] of S.inflight) {
      // A row the snapshot lacks is gone, unless its request.start came after the snapshot.
      if (!snap.has(id) && (row.startEvent === null || row.startEvent <= S.snapshotEventId)) {
        S.inflight.delete(id);
      }
    }
    for (const [id, r] of snap) {
      if (S.ended.has(id)) continue;
      const old = S.inflight.get(id);
      S.inflight.set(id, {
        id, method: r.method, path: r.path, model: r.model, host: r.host, engine: r.engine,
        streaming: r.streaming, status: r.status, bytes: r.bytes, events: r.events,
        started: at - r.age_seconds * 1000, startEvent: old ? old.startEvent : null,
      });
    }
  }

  // Debounced re-reads: events ask, one read serves all that asked meanwhile.
  const pending = { status: false, models: false };
  let refreshTimer = null;
  let refreshing = false;

  function refresh(models, delay) {
    pending.status = true;
    pending.models = pending.models || !!models;
    if (refreshTimer !== null) return;
    refreshTimer = setTimeout(runRefresh, delay === undefined ? 200 : delay);
  }

  async function runRefresh() {
    refreshTimer = null;
    if (refreshing) {
      refreshTimer = setTimeout(runRefresh, 200);
      return;
    }
    refreshing = true;
    const want = { ...pending };
    pending.status = pending.models = false;
    try {
      await Promise.all([want.status ? loadStatus() : null, want.models ? loadModels() : null]);
    } finally {
      refreshing = false;
    }
  }

  // -- the event stream ------------------------------------------------------------------
  function connect() {
    const es = new EventSource(own("/api/events"));
    S.es = es;
    for (const type of EVENT_TYPES) {
      es.addEventListener(type, (e) => {
        if (S.es !== es) return;
        let data;
        try {
          data = JSON.parse(e.data);
        } catch {
          return;
        }
        handle(Number(e.lastEventId) || 0, data.type || type, data, Date.now());
      });
    }
    es.onopen = () => {
      if (S.es !== es) return;
      if (S.broken) {
        // Reconnected: the stream resumes after our Last-Event-ID (or says reset),
        // so nothing repeats; and a restarted proxy numbers its events anew.
        S.seen.clear();
        S.offset = null;
      }
      S.broken = false;
      S.retryMs = 1000;
      S.refused = null;
      setConn("live");
      // Read the snapshot after the stream is attached: every event after it comes live.
      const backfillWanted = S.needsBackfill;
      S.needsBackfill = false;
      Promise.all([loadStatus(), loadModels()]).then(() => {
        if (backfillWanted) backfill(S.snapshotEventId);
      });
    };
    es.onerror = () => {
      if (S.es !== es) return;
      S.broken = true;
      if (S.conn !== "polling") setConn("reconnecting");
      if (es.readyState === EventSource.CLOSED) {
        // The browser gave up (an HTTP error: 503 while the proxy stops, or when
        // it serves all the streams it allows): a new EventSource, later. It has
        // no Last-Event-ID: backfill instead.
        S.es = null;
        S.needsBackfill = true;
        whyClosed().then((wait) => setTimeout(connect, wait));
      }
    };
  }

  // EventSource does not say why it gave up: ask /api/events once more with
  // fetch (and let go of it at once). A refusal for too many subscribers turns
  // the page to polling /status until a retry gets a stream. The wait before
  // that retry (ms).
  async function whyClosed() {
    let wait = S.retryMs;
    S.retryMs = Math.min(S.retryMs * 2, 10000);
    let refused = null;
    const ctrl = new AbortController();
    const timer = setTimeout(() => ctrl.abort(), 5000);
    try {
      const r = await fetch(own("/api/events"), {
        cache: "no-store", signal: ctrl.signal, headers: { Accept: "text/event-stream" },
      });
      if (r.status === 503 && r.headers.get("content-type") === "application/json") {
        const doc = await r.json();
        if (doc && doc.error && doc.error.code === "too_many_subscribers") {
          refused = String(doc.error.message);
          wait = Math.max(wait, 1000 * (Number(r.headers.get("retry-after")) || 5));
        }
      }
    } catch {
      // unreachable or aborted: the proxy is gone for now, keep reconnecting
    } finally {
      clearTimeout(timer);
      ctrl.abort();
    }
    S.refused = refused;
    setConn(refused === null ? "reconnecting" : "polling");
    if (refused !== null) refresh(false, 0);
    return wait;
  }

  function setConn(state) {
    S.conn = state;
    dirty("conn");
  }

  // Every event is handled once. Live ones (`recv`: when it came) change the
  // page's model; backfilled ones (`recv` null) only when newer than the snapshot.
  function handle(id, type, data, recv) {
    if (type === "reset") {
      onReset(id, data);
      return;
    }
    if (id) {
      if (S.seen.has(id)) return;
      S.seen.add(id);
      if (S.seen.size > 5000) S.seen = new Set([...S.seen].slice(-2000));
    }
    if (recv !== null && typeof data.time === "number") noteOffset(recv / 1000 - data.time);
    if (type === "engine.exit") noteExit(data);
    if (recv !== null || id > S.snapshotEventId) apply(id, type, data);
    if (listed(type, data)) addEvent(id, type, data);
  }

  // An engine's last exit, backfilled or live: its log tail stays for the host's card.
  function noteExit(data) {
    const key = data.host + " " + data.engine;
    const old = S.exits.get(key);
    if (!old || (old.time || 0) <= (data.time || 0)) S.exits.set(key, data);
  }

  function onReset(id, data) {
    // The proxy no longer has the events after our Last-Event-ID (a new process,
    // or too many missed): start over from its snapshot and its recent events.
    S.seen.clear();
    S.ended.clear();
    for (const row of S.inflight.values()) row.startEvent = null;
    S.offset = null;
    addEvent(id, "reset", data);
    Promise.all([loadStatus(), loadModels()]).then(() => backfill(id));
  }

  function apply(id, type, data) {
    const rid = data.request_id;
    switch (type) {
      case "request.start": {
        if (!S.ended.has(rid)) {
          const old = S.inflight.get(rid);
          S.inflight.set(rid, {
            bytes: 0, events: 0, status: null, ...(old || {}),
            id: rid, method: data.method, path: data.path, model: data.model, host: data.host,
            engine: data.engine, streaming: data.streaming,
            started: old ? old.started : localMs(data.time), startEvent: id || null,
          });
          dirty("inflight");
        }
        // its status and first bytes come with the next snapshot: soon
        refresh(false, 600);
        break;
      }
      case "request.end":
        document.dispatchEvent(new CustomEvent("llmproxy:request-end", { detail: data }));
        if (data.model !== null && data.model !== undefined) S.ended.set(rid, Date.now());
        if (S.inflight.delete(rid)) dirty("inflight");
        if (data.engine) refresh(false);
        break;
      case "reload":
      case "roster":
        refresh(true);
        break;
      case "stop":
        // The stream ends right after this: say so now, the re-read may not make it.
        if (S.status && (data.stage === "signal" || data.stage === "begun")) {
          S.status.state = "draining";
          dirty("all");
        }
        refresh(false);
        break;
      case "engine.switch":
      case "engine.idle_stop":
      case "engine.command":
      case "engine.exit":
      case "engine.unhealthy":
      case "host.sleep":
      case "host.wake":
        // a model's state (loading, loaded, failed, asleep, waking) is in /v1/models
        refresh(true);
        break;
      case "ready":
      case "upgrade":
      case "host.cordon":
      case "queue.update":
        refresh(false);
        break;
      default:
        break;
    }
  }

  // The page's own /status reads (and other non-API requests) are not listed.
  function listed(type, data) {
    return !(type === "request.end" && (data.model === null || data.model === undefined));
  }

  function addEvent(id, type, data) {
    if (S.events.some((e) => e.id === id && e.type === type && e.data.time === data.time)) return;
    S.events.push({ id, type, data });
    S.events.sort((a, b) => (b.data.time || 0) - (a.data.time || 0) || b.id - a.id);
    if (S.events.length > MAX_EVENTS) S.events.length = MAX_EVENTS;
    dirty("events");
  }

  // The recent events the proxy still has, up to `target`, for the events list:
  // a plain fetch of /api/events with a Last-Event-ID, read until `target`.
  async function backfill(target) {
    const floor = Math.floor(target / IDS_PER_GENERATION) * IDS_PER_GENERATION;
    const from = Math.max(target - BACKFILL_SPAN, floor);
    if (!target || from >= target) return;
    const ctrl = new AbortController();
    const timer = setTimeout(() => ctrl.abort(), 5000);
    try {
      const r = await fetch(own("/api/events"), {
        headers: { "Last-Event-ID": String(from), Accept: "text/event-stream" },
        cache: "no-store", signal: ctrl.signal,
      });
      if (!r.ok || !r.body) return;
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const msg = parseBlock(buf.slice(0, cut));
          buf = buf.slice(cut + 2);
          if (!msg) continue;
          if (msg.event === "reset") return;     // the proxy has none of them
          handle(msg.id, msg.data.type || msg.event, msg.data, null);
          if (msg.id >= target) return;
        }
      }
    } catch {
      // aborted or failed: the list simply starts with the live events
    } finally {
      clearTimeout(timer);
      ctrl.abort();
    }
  }

  function parseBlock(block) {
    let id = 0;
    let event = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (!line || line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "id") id = Number(value) || 0;
      else if (field === "event") event = value;
      else if (field === "data") data.push(value);
    }
    if (!data.length) return null;
    try {
      return { id, event, data: JSON.parse(data.join("\n")) };
    } catch {
      return null;
    }
  }

  // -- rendering -----------------------------------------------------------------------------
  const dirtySet = new Set();
  let renderTimer = null;

  function dirty(part) {
    dirtySet.add(part);
    if (renderTimer === null) renderTimer = setTimeout(render, 16);
  }

  function render() {
    renderTimer = null;
    const all = dirtySet.has("all");
    const parts = new Set(dirtySet);
    dirtySet.clear();
    if (all || parts.has("conn")) renderConn();
    if (all) renderFacts();
    if (all || parts.has("inflight")) renderHosts();   // each host's count in flight
    if (all || parts.has("inflight")) renderInflight();
    if (all || parts.has("models")) renderModels();
    if (all) renderKeys();
    if (all) renderLifecycle();
    if (all || parts.has("events")) renderEvents();
    document.dispatchEvent(new CustomEvent("llmproxy:rendered", { detail: { parts, all } }));  // other panels' hook
  }

  function renderConn() {
    const conn = $("conn");
    conn.dataset.conn = S.conn;
    conn.textContent = { live: "live", reconnecting: "reconnecting…", connecting: "connecting…",
      polling: "polling" }[S.conn];
    const banner = $("banner");
    let text = "";
    if (S.conn === "reconnecting") {
      text = "The live event stream was lost: reconnecting… What is shown may be out of date.";
    } else if (S.conn === "polling") {
      text = "No live updates: the proxy refused this page's event stream: " + S.refused + ". "
        + "This page re-reads /status every " + POLL_REFUSED_MS / 1000 + " s instead (the events "
        + "list is not updated meanwhile) and tries the live stream again every few seconds.";
      if (S.statusError) text += " The last read failed: " + S.statusError;
    } else if (S.statusError) {
      text = "Could not read the proxy's status: " + S.statusError;
    }
    banner.hidden = !text;
    banner.textContent = text;
    const fresh = S.conn === "live" || S.conn === "polling";
    document.body.classList.toggle("stale", !fresh);
    $("state").title = fresh ? "the proxy's state" : "the proxy's last known state";
  }

  const STATE_TONE = { ready: "ok", starting: "info", standby: "info", reloading: "warn", upgrading: "warn", draining: "bad" };

  function renderFacts() {
    const st = S.status;
    if (!st) return;
    $("version").textContent = "v" + st.version;
    const state = $("state");
    state.dataset.state = st.state;
    state.className = "pill " + (STATE_TONE[st.state] || "");
    state.textContent = st.state;
    // A standby: whom it waits for, per managed host (text only).
    const waits = Object.entries(st.waiting_for || {}).map(([host, who]) => host + ": " + who);
    state.title = waits.length ? "standby, waiting for " + waits.join("; ") : state.title;
    document.title = "llmproxy · " + st.state;
    $("pid").textContent = st.pid;
    const gen = [String(st.generation)];
    if (st.predecessor) gen.push(" · from " + st.predecessor.pid);
    $("generation").textContent = gen.join("");
    replace($("uptime"), since(S.statusAt - st.uptime_seconds * 1000));
    $("listening").textContent = st.listening || "—";
    $("config-gen").textContent = st.config ? "gen " + st.config.generation : "—";
    renderSpeedups(st.speedups);
    replace($("updated"), since(S.statusAt, " ago"));
  }

  // Which fast paths run: "off" (the reference path alone), or the active ones;
  // each one off is named with its reason in the tooltip and a warning tone.
  function renderSpeedups(sp) {
    const el = $("speedups");
    if (!sp) { el.textContent = "—"; return; }
    const off = Object.entries(sp.off || {});
    if (!sp.enabled) {
      el.textContent = "off (reference path)";
      el.title = "LLMPROXY_SPEEDUPS=0";
      el.dataset.tone = "";
      return;
    }
    el.textContent = (sp.active.length ? sp.active.join(", ") : "none")
      + (off.length ? " · off: " + off.map(([name]) => name).join(", ") : "");
    el.title = off.map(([name, why]) => name + ": " + why).join("\n");
    el.dataset.tone = off.length ? "warn" : "";
  }

  function rosterState(roster) {
    if (roster.last_error && roster.fetched_seconds_ago === null) return ["unreachable", "bad"];
    if (roster.last_error && roster.last_error_seconds_ago !== null
        && roster.last_error_seconds_ago < roster.fetched_seconds_ago) {
      return roster.models.length ? ["stale", "warn"] : ["failed", "bad"];
    }
    if (roster.fetched_seconds_ago === null) return ["not read", ""];
    return ["ok", "ok"];
  }

  function renderHosts() {
    const st = S.status;
    if (!st) return;
    const at = S.statusAt;
    const busy = {};
    for (const row of S.inflight.values()) if (row.host) busy[row.host] = (busy[row.host] || 0) + 1;
    $("hosts-count").textContent = st.hosts.length;
    const cards = st.hosts.map((host) => {
      const roster = host.roster;
      const [label, tone] = rosterState(roster);
      const rows = [
        kv("Roster", [
          plural(roster.models.length, "model"),
          roster.fetched_seconds_ago !== null
            ? [" · read ", since(at - roster.fetched_seconds_ago * 1000, " ago")] : " · never read",
        ]),
      ];
      if (roster.models.length) {
        rows.push(kv("Serves", h("span", { class: "chips" }, roster.models.map((m) => mono(m, "chip")))));
      }
      if (roster.last_error) {
        rows.push(kv("Last error", [
          h("span", { class: "err" }, roster.last_error),
          roster.last_error_seconds_ago !== null
            ? [muted(" · "), since(at - roster.last_error_seconds_ago * 1000, " ago")] : null,
        ], "error"));
      }
      rows.push(kv("In flight", String(busy[host.name] || 0)));
      const cap = host.capacity;
      if (cap && (cap.max_concurrent !== null || cap.queued)) {
        rows.push(kv("Slots", [`${cap.in_flight} of ${cap.max_concurrent === null ? "∞" : cap.max_concurrent}`,
          ` · ${cap.queued} queued (max ${cap.max_queue})`]));
      }
      if (host.queue && host.queue.length) rows.push(kv("Queue", queueList(host.queue)));
      if (host.managed) rows.push(...engineRows(host.engine, at, host.name));
      const watch = watchState(host.engine);
      const sleep = window.llmproxySleep && window.llmproxySleep.badge(host);  // page/sleep.js
      return h("article", { class: "host", "data-host": host.name },
        h("header", { class: "host-head" },
          h("h3", null, host.name),
          badge("roster " + label, tone, "the host's last /v1/models read"),
          host.managed ? badge("managed", "info", "llmproxy starts and stops its engines") : null,
          host.capacity && host.capacity.cordoned
            ? badge("cordoned", "warn", "takes no new requests; what runs there finishes") : null,
          watch ? badge(watch[0], watch[1], watch[2]) : null,
          sleep ? badge(sleep[0], sleep[1], sleep[2]) : null),
        h("div", { class: "host-url mono" }, host.url),
        h("dl", { class: "kv" }, rows));
    });
    replace($("hosts"), cards.length ? cards : h("p", { class: "empty" }, "No hosts."));
  }

  // A host's waiters in served order (observe/queueview.py): position, engine,
  // priority class, seconds waited and the estimated wait (never a promise).
  function queueList(queue) {
    return h("ol", { class: "queue" }, queue.map((w) => h("li", { "data-position": String(w.position) },
      ordinal(w.position), " · ", w.stop ? muted("stop") : w.engine ? mono(w.engine) : muted("any engine"),
      " · ", w.priority, " · waited ", Math.round(w.waited_seconds) + " s",
      " · ", w.eta_seconds === null ? muted("ETA unknown") : "ETA about " + Math.ceil(w.eta_seconds) + " s")));
  }

  function ordinal(n) {
    const teen = n % 100 >= 10 && n % 100 <= 20;
    return n + (teen ? "th" : ({ 1: "st", 2: "nd", 3: "rd" }[n % 10] || "th"));
  }

  function kv(label, value, cls) {
    return h("div", { class: "kv-row" + (cls ? " " + cls : "") }, h("dt", null, label), h("dd", null, value));
  }

  // A managed host's watch (llmproxy-agent watch over ssh) when it is not up:
  // [label, tone, tooltip], or null while it is up (or the host has none).
  function watchState(engine) {
    const w = engine && engine.watch;
    if (!w || w.connected) return null;
    if (w.last_error) return ["unreachable", "bad", "its watch session is down: " + w.last_error];
    return ["connecting", "info", "its watch session is not up yet"];
  }

  function watchRows(w, at) {
    if (!w || w.connected) return [];
    return [kv("Watch", [w.last_error ? "down" : "not up yet",
      typeof w.down_seconds === "number" ? [" for ", since(at - w.down_seconds * 1000, "")] : null,
      w.last_error ? h("div", { class: "err" }, w.last_error) : null], w.last_error ? "error" : null)];
  }

  // Each engine with a crash history: its state, crashes and last exit; for one
  // restarting, failed or exited (not restarted), the last lines of its log (from its engine.exit event,
  // else the last line /status kept). Engine text is only ever inserted as text.
  function supervisionRows(engine, hostName, at) {
    const rows = [];
    for (const [name, rec] of Object.entries(engine.supervision || {})) {
      const state = String(rec.state);
      const down = state === "failed" || state === "restarting" || state === "exited";
      const value = [badge(state, state === "failed" ? "bad" : down ? "warn" : ""), " ",
        rec.crashes + (rec.crashes === 1 ? " crash" : " crashes") + " in 10 min",
        rec.last_exit ? [" · last ", mono(rec.last_exit)] : null,
        state === "restarting" && typeof rec.restart_in_seconds === "number"
          ? [" · restart ", until(at + rec.restart_in_seconds * 1000)] : null];
      const exit = S.exits.get(hostName + " " + name);
      const tail = exit && Array.isArray(exit.log_tail) ? exit.log_tail.slice(-TAIL_SHOWN).map(String) : [];
      if (!tail.length && rec.last_line) tail.push(String(rec.last_line));
      if (down && tail.length) value.push(h("pre", { class: "logtail" }, tail.join("\n")));
      const row = kv("Crashes · " + name, value, state === "failed" ? "error" : null);
      row.dataset.engine = name;
      rows.push(row);
    }
    return rows;
  }

  // One row per GPU the host's watch reports: what the agent could read of it.
  function gpuRows(w) {
    if (!w || !Array.isArray(w.gpus)) return [];
    const num = (x) => typeof x === "number" && isFinite(x);
    return w.gpus.filter((g) => g && typeof g === "object").map((g) => {
      const said = [];
      if (num(g.memory_used_bytes) && num(g.memory_total_bytes)) {
        said.push(fmtGiB(g.memory_used_bytes) + " of " + fmtGiB(g.memory_total_bytes) + " GiB");
      }
      if (num(g.utilization_ratio)) said.push(Math.round(g.utilization_ratio * 100) + "%");
      if (num(g.temperature_celsius)) said.push(Math.round(g.temperature_celsius) + " °C");
      if (num(g.power_watts)) said.push(Math.round(g.power_watts) + " W");
      const row = kv("GPU " + String(g.index), [h("span", { class: "gpu-name" }, String(g.name ?? "")),
        said.length ? " · " + said.join(" · ") : "", w.connected ? null : muted(" · last known")]);
      row.dataset.gpu = String(g.index);
      return row;
    });
  }

  const fmtGiB = (n) => (n / 2 ** 30).toFixed(1);

  function engineRows(engine, at, hostName) {
    if (!engine) return [kv("Engine", muted("unknown"))];
    const rows = [];
    let now;
    if (engine.switching_to) {
      now = [engine.running ? mono(engine.running) : muted("none"), " → ", mono(engine.switching_to),
        " ", badge("switching", "warn")];
    } else if (engine.operation) {
      now = [engine.running ? mono(engine.running) : muted("none"), " ", badge(engine.operation, "warn")];
    } else if (engine.memory_gb) {
      // A budgeted host runs several engines: each has its row below.
      const loaded = (engine.resident || []).filter((r) => r.state === "loaded").length;
      now = loaded ? [plural(loaded, "engine") + " ", badge("loaded", "ok")] : [muted("none loaded")];
    } else {
      now = engine.running ? [mono(engine.running), " ", badge("running", "ok")] : [muted("stopped")];
    }
    if (engine.protected) now.push(" ", badge("protected", "info", "a previous llmproxy still streams from it"));
    if (engine.resident_seconds_left) {
      now.push(" ", badge("resident", "info", "min_engine_seconds: it keeps the host while requests for it come"));
    }
    rows.push(kv("Engine", now));
    if (engine.memory_gb) rows.push(...residentRows(engine));
    rows.push(kv("Load", [plural(engine.in_flight, "request") + " in flight · ", engine.queued + " queued"]));
    if (engine.idle_stop_in_seconds !== null && engine.idle_stop_in_seconds !== undefined) {
      rows.push(kv("Idle stop", until(at + engine.idle_stop_in_seconds * 1000)));
    } else if (engine.last_used_seconds_ago !== null && engine.last_used_seconds_ago !== undefined
               && engine.running) {
      rows.push(kv("Last used", since(at - engine.last_used_seconds_ago * 1000, " ago")));
    }
    if (engine.held_by) rows.push(kv("Lease", engine.held_by, "error"));
    rows.push(...watchRows(engine.watch, at), ...supervisionRows(engine, hostName, at),
      ...gpuRows(engine.watch));
    const last = engine.last_switch;
    if (last) {
      rows.push(kv("Last switch", [
        badge(last.outcome, last.outcome === "ok" ? "ok" : "bad"), " ", mono(last.engine),
        typeof last.elapsed === "number" ? " in " + fmtSeconds(last.elapsed) : "",
        muted(" · " + fmtClock(last.at)),
        last.reason ? h("div", { class: "err" }, last.reason) : null,
      ]));
    }
    return rows;
  }

  // What an engine's memory figure is: measured beside declared, or the whole budget.
  function memoryNote(r) {
    const declared = r.declared_memory_gb == null ? "none" : String(r.declared_memory_gb);
    if (r.measured_memory_gb != null) {
      return muted(" (measured " + r.measured_memory_gb + ", declared " + declared + ")");
    }
    return r.declared_memory_gb == null ? muted(" (no memory_gb, not measured yet)") : "";
  }

  // A host with memory_gb: each engine on it (state, memory, since, in flight), and the budget.
  function residentRows(engine) {
    const mem = engine.memory_gb;
    const rows = [kv("Memory", [String(mem.used), " of ", String(mem.budget), " GB in use"])];
    for (const r of engine.resident || []) {
      const state = badge(r.state, r.state === "loaded" ? "ok" : "warn");
      rows.push(kv("· " + r.engine, [state, " ", String(r.memory_gb), " GB", memoryNote(r), " · ",
        plural(r.in_flight, "request") + " in flight",
        typeof r.since_seconds === "number" ? muted(" · for " + fmtSeconds(r.since_seconds)) : ""]));
    }
    return rows;
  }

  function renderInflight() {
    const rows = [...S.inflight.values()].sort((a, b) => a.started - b.started);
    $("inflight-count").textContent = rows.length || "";
    $("inflight-empty").hidden = rows.length > 0;
    $("inflight").hidden = rows.length === 0;
    replace($("inflight").tBodies[0], rows.map((r) => h("tr", { "data-id": r.id },
      h("td", null, mono(r.id, "id")),
      h("td", null, mono(r.model), r.streaming ? badge("stream", "info", "a streaming request") : null),
      h("td", null, r.host || "—", r.engine ? muted(" · " + r.engine) : null),
      h("td", { class: "num" }, since(r.started, "", true)),
      h("td", { class: "num" }, fmtBytes(r.bytes)),
      h("td", { class: "num" }, String(r.events ?? 0)),
      h("td", null, requestState(r)))));
  }

  function requestState(r) {
    if (r.status === null || r.status === undefined) {
      return r.startEvent ? badge("sent", "info", "forwarded; no answer to the client yet")
        : badge("waiting", "", "no answer to the client yet");
    }
    return badge(String(r.status), r.status < 400 ? "ok" : "bad");
  }

  const MODEL_TONE = { loaded: "ok", loading: "warn", failed: "bad" };
  const MODEL_STATE = {
    loaded: "its engine runs", loading: "its engine is starting", unloaded: "its engine is not running",
    failed: "its engine failed after a crash loop (llmproxy engine HOST start ENGINE tries again)",
  };

  function renderModels() {
    const models = S.models || [];
    $("models-count").textContent = models.length || "";
    $("models-empty").hidden = models.length > 0 || S.models === null;
    replace($("models").tBodies[0], models.map((m) => {
      const x = m.llmproxy || {};
      return h("tr", { "data-model": m.id },
        h("td", null, mono(m.id), x.alias_of ? h("span", { class: "alias" }, "alias of ", mono(x.alias_of)) : null),
        h("td", null, x.host || m.owned_by || "—", x.engine ? muted(" · " + x.engine) : null),
        h("td", null, mono(x.upstream || "—", "muted")),
        h("td", { class: "num" }, m.context_length ? m.context_length.toLocaleString("en-US") : "—"),
        h("td", null, x.available === false ? badge("no", "bad", "the host's last roster does not list it")
          : badge("yes", "ok")),
        h("td", { class: "state" }, x.state ? badge(x.state, MODEL_TONE[x.state] || "", MODEL_STATE[x.state])
          : muted("—")));
    }));
  }

  // Each key's use against its limits (/status access.per_key): what is left of
  // its requests and tokens per minute, and how often it was refused.
  function limitCell(left, limit) {
    if (typeof limit !== "number") return h("td", null, muted("no limit"));
    const tone = left <= 0 ? "bad" : left < limit / 10 ? "warn" : "ok";
    return h("td", null, badge(String(left) + " left", tone), muted(" of " + limit));
  }

  // A key's GPU energy (docs/energy.md), against its wh_per_day budget when it has one.
  function energyCell(k) {
    const j = k.energy_joules || 0;
    const text = j >= 3600 ? (j / 3600).toFixed(2) + " Wh" : j.toFixed(1) + " J";
    const b = k.energy_budget;
    if (!b) return h("td", { class: "num" }, text);
    const tone = b.remaining_wh <= 0 ? "bad" : b.remaining_wh < b.wh_per_day / 10 ? "warn" : "ok";
    return h("td", { class: "num", title: "budget " + b.wh_per_day + " Wh per UTC day" },
      badge(text, tone), muted(" of " + b.wh_per_day + " Wh/day"));
  }

  function renderKeys() {
    const access = (S.status && S.status.access) || {};
    const keys = access.keys ? access.per_key || [] : [];
    $("keys-panel").hidden = !access.keys;
    $("keys-count").textContent = keys.length || "";
    replace($("keys").tBodies[0], keys.map((k) => {
      const lim = k.limits || {};
      const refused = lim.ratelimited || {};
      const total = (refused.requests || 0) + (refused.tokens || 0);
      return h("tr", { "data-key": String(k.name) },
        h("td", null, mono(String(k.name)), k.configured === false ? muted(" (gone from the file)") : null),
        h("td", null, k.priority ? badge(String(k.priority), k.priority === "high" ? "ok" : "") : muted("—")),
        h("td", { class: "num" }, String(k.requests ?? 0)),
        h("td", { class: "num" }, String((k.prompt_tokens || 0) + (k.completion_tokens || 0))),
        energyCell(k),
        limitCell(lim.remaining_requests, lim.rpm),
        limitCell(lim.remaining_tokens, lim.tpm),
        h("td", { class: "num" }, total ? badge(String(total), "bad") : "0"));
    }));
  }

  function renderLifecycle() {
    const st = S.status;
    if (!st) return;
    const out = [];
    const cfg = st.config || {};
    const reload = cfg.last_reload;
    out.push(h("div", { class: "life", id: "last-reload" },
      h("div", { class: "life-head" }, h("h3", null, "Last reload"),
        reload ? badge(reload.outcome, reload.outcome === "applied" ? "ok" : "warn") : badge("none", "")),
      reload ? [
        h("p", { class: "life-msg" }, reloadText(reload.message)),
        h("p", { class: "muted small" }, "at " + fmtClock(reload.at) + " · ",
          since(localMs(reload.at), " ago"), " · config generation " + reload.generation),
      ] : h("p", { class: "muted small" }, "None since the process started (config generation "
        + (cfg.generation ?? "—") + ")."),
      cfg.path ? h("p", { class: "small path" }, muted("file "), mono(cfg.path)) : null));

    const up = st.last_upgrade;
    const upRows = [];
    if (up) {
      upRows.push(h("p", { class: "life-msg" },
        up.outcome === "handed over" ? "Handed over to pid " : "Candidate pid ",
        mono(String(up.candidate_pid ?? "—")), up.reason ? [": ", h("span", { class: "err" }, up.reason)] : null));
      upRows.push(h("p", { class: "muted small" }, "at " + fmtClock(up.at) + " · ", since(localMs(up.at), " ago")));
    }
    if (st.predecessor) {
      upRows.push(h("p", { class: "small" }, "This process (generation " + st.generation + ") took over from pid ",
        mono(String(st.predecessor.pid)), " ",
        st.predecessor.draining ? badge("draining", "warn") : muted("· exited")));
    }
    if (st.successor_pid) {
      upRows.push(h("p", { class: "small" }, "Successor pid ", mono(String(st.successor_pid))));
    }
    if (!upRows.length) upRows.push(h("p", { class: "muted small" }, "None since the process started."));
    const upTone = !up ? "" : up.outcome === "failed" ? "bad" : "ok";
    out.push(h("div", { class: "life", id: "last-upgrade" },
      h("div", { class: "life-head" }, h("h3", null, "Last upgrade"),
        badge(up ? up.outcome : st.predecessor ? "took over" : "none", up ? upTone : st.predecessor ? "ok" : "")),
      upRows));
    replace($("lifecycle"), out);
  }

  // "reload: applied models (+x)" says "reload" once too often here.
  const reloadText = (message) => String(message || "").replace(/^reload: /, "");

  function renderEvents() {
    $("events-empty").hidden = S.events.length > 0;
    replace($("events"), S.events.map((e) => {
      const [text, tone] = describe(e.type, e.data);
      return h("li", { class: "event " + (tone || ""), "data-type": e.type, "data-id": e.id || null },
        h("time", { class: "mono" }, fmtClock(e.data.time)),
        h("span", { class: "etype" }, e.type),
        h("span", { class: "etext" }, text));
    }));
  }

  // One line per event: what happened, and its tone (ok, warn, bad, or none).
  function describe(type, d) {
    const t = (x) => (x === null || x === undefined ? "—" : String(x));
    switch (type) {
      case "request.start":
        return [`${d.request_id} ${t(d.model)} → ${t(d.host)}${d.engine ? " (" + d.engine + ")" : ""}`
          + (d.streaming ? " · stream" : ""), ""];
      case "request.end": {
        const good = d.outcome === "completed" && (d.status === null || d.status < 400);
        return [`${d.request_id} ${t(d.model)} → ${t(d.host)} · ${t(d.status)} ${d.outcome}`
          + ` · ${fmtBytes(d.bytes)} in ${fmtSeconds(d.duration)}` + (d.detail ? ` (${d.detail})` : ""),
        good ? "" : "warn"];
      }
      case "roster":
        if (d.outcome === "failed") return [`${d.host}: read ${d.read} failed: ${t(d.error)}`, "bad"];
        if (d.outcome === "stale") return [`${d.host}: dropped read ${d.read} (older than ${d.stored})`, ""];
        return [`${d.host}: ${plural(d.models, "model")} (read ${d.read})`, "ok"];
      case "engine.switch": {
        const head = `${d.host}: ${t(d.previous)} → ${d.engine}`;
        if (d.stage === "waiting") {
          return [`${head}: waiting ` + (d.reason === "protected" ? "(the previous llmproxy uses it)"
            : d.reason === "residency" ? "(residency)"
            : d.reason === "memory" ? `for ${t(d.previous)} to fall idle (memory_gb)`
            : `for ${plural(d.waiting_for, "request")}`), ""];
        }
        if (d.stage === "begun") return [`${head}: starting`, ""];
        if (d.stage === "done") return [`${head}: ready in ${fmtSeconds(d.elapsed)}`, "ok"];
        return [`${head}: failed: ${t(d.reason)}`, "bad"];
      }
      case "engine.idle_stop": {
        const what = (!d.why || d.why === "idle") ? `idle stop of ${d.engine}` : `stop of ${d.engine} (${d.why})`;
        if (d.stage === "failed") return [`${d.host}: ${what} failed: ${t(d.reason)}`, "bad"];
        return [`${d.host}: ${what} ${d.stage}`
          + (d.stage === "done" ? ` in ${fmtSeconds(d.elapsed)}` : ""), ""];
      }
      case "ready":
        return [`listening on ${t(d.address)} (${d.origin}): ${d.summary}`
          + (d.failed_hosts && d.failed_hosts.length ? ` · no roster from ${d.failed_hosts.join(", ")}` : ""),
        d.failed_hosts && d.failed_hosts.length ? "warn" : "ok"];
      case "reload":
        return [reloadText(d.message), d.outcome === "applied" ? "ok" : "warn"];
      case "upgrade": {
        const parts = [d.stage];
        if (d.candidate_pid) parts.push(`pid ${d.pid} → ${d.candidate_pid}`);
        else parts.push(`pid ${d.pid}`);
        if (d.generation) parts.push(`generation ${d.generation}`);
        if (d.reason) parts.push(d.reason);
        return [parts.join(" · "), d.stage === "failed" ? "bad" : d.stage === "ignored" ? "warn" : "ok"];
      }
      case "stop":
        if (d.stage === "signal") return [`received ${t(d.reason)}: stopping`, "warn"];
        if (d.stage === "begun") return [`stopping: ${plural(d.in_flight, "request")} in flight`
          + (d.reason ? `, budget ${d.reason}` : ""), "warn"];
        if (d.stage === "drained") return ["drained, exiting", ""];
        return [`drain time over: cut ${plural(d.in_flight, "request")}`, "bad"];
      case "reset":
        return ["event stream restarted: " + t(d.reason), "warn"];
      case "queue.reject":
        return [`${t(d.request_id)} refused by ${d.host}: ` + (d.reason === "queue_full"
          ? `queue full (${d.depth} waiting)` : `waited ${fmtSeconds(d.waited)}`), "warn"];
      case "host.cordon":
        return [`${d.host} ` + (d.cordoned ? `cordoned (${d.in_flight} in flight, ${d.queued} queued)`
          : "uncordoned"), d.cordoned ? "warn" : "ok"];
      case "replica.failover":
        return [`${t(d.request_id)} ${d.model}: ${d.host} unreachable (${d.reason}) → ${d.next_host}`, "warn"];
      case "route.fallback":
        return [`${t(d.request_id)} ${d.model}: no host could take it (${d.reason}) → ${d.fallback}`, "warn"];
      case "engine.command":
        return [`${d.host}: ${d.op} ${d.engine || ""} ${d.stage}` + (d.reason ? `: ${d.reason}` : ""),
          d.stage === "failed" ? "bad" : d.stage === "done" ? "ok" : ""];
      case "engine.exit": {
        const tail = Array.isArray(d.log_tail) && d.log_tail.length ? `: ${d.log_tail[d.log_tail.length - 1]}` : "";
        return [`${d.host}: ${d.engine} died (${t(d.exit)})${tail}; ${afterCrash(d)}`, "bad"];
      }
      case "engine.unhealthy":
        return [`${d.host}: ${d.engine} hung (health failing for ${fmtSeconds(d.seconds)}, `
          + `nothing sent): replaced; ${afterCrash(d)}`, "bad"];
      default:
        return (window.llmproxySleep && window.llmproxySleep.describe(type, d)) || [JSON.stringify(d), ""];
    }
  }

  function afterCrash(d) {
    if (d.failed) return `failed after ${d.crashes} crashes within 10 minutes`;
    return typeof d.restart_in === "number" ? `restarting in ${fmtSeconds(d.restart_in)}` : "not restarted";
  }

  // -- the clock: ticking values, light re-reads -------------------------------------------
  function tick() {
    const now = Date.now();
    for (const el of document.querySelectorAll("[data-since]")) {
      el.textContent = sinceText(el, now);
    }
    for (const el of document.querySelectorAll("[data-until]")) {
      el.textContent = untilText(Number(el.dataset.until), now);
    }
    for (const [id, at] of S.ended) if (now - at > 120000) S.ended.delete(id);
    if (!document.hidden && (S.conn === "live" || S.conn === "polling")) {
      const every = S.conn === "polling" ? POLL_REFUSED_MS : S.inflight.size ? POLL_BUSY_MS
        : watched() ? POLL_WATCHED_MS : POLL_IDLE_MS;
      if (now - S.statusAt >= every) refresh(false, 0);
    }
  }

  // Whether some host is watched (llmproxy-agent watch): its GPU figures and its
  // watch's state change without an event, so /status is re-read more often.
  const watched = () => !!S.status && (S.status.hosts || []).some((x) => x.engine && x.engine.watch);

  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) refresh(true, 0);
  });

  // -- start ----------------------------------------------------------------------------------
  window.llmproxyPage = { loadedAt: Date.now(), state: S };
  refresh(true, 0);
  connect();
  setInterval(tick, 1000);
})();
