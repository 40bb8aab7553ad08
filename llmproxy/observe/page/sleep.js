// Hosts that sleep and wake (hosts/sleepwake.py), for the status page: the badge
// of a host that is asleep, going to sleep or waking (from /status's
// engine.sleep), and the lines of the host.sleep and host.wake events. app.js
// asks window.llmproxySleep for both; nothing here touches the page itself.
"use strict";

(() => {
  const BADGES = {
    asleep: ["asleep", "info", "its agent put it to sleep; a request for its models wakes it"],
    sleeping: ["going to sleep", "info", "its agent was told to sleep"],
    waking: ["waking", "warn", "magic packet sent; waiting for its agent to answer"],
  };

  // [label, tone, tooltip] for a host's sleep state, or null while it is awake.
  function badge(host) {
    const sleep = host.engine && host.engine.sleep;
    if (!sleep) return null;
    const found = BADGES[sleep.state];
    if (!found) return null;
    if (sleep.no_wake_for_seconds) {
      return ["asleep", "bad", `a wake timed out: no new wake for ${Math.ceil(sleep.no_wake_for_seconds)} s`];
    }
    return found;
  }

  // [text, tone] of a host.sleep or host.wake event, or null for any other.
  function describe(type, d) {
    if (type === "host.sleep") {
      if (d.refused) return [`${d.host}: not sent to sleep: ${d.refused}`, "warn"];
      return [d.why === "idle" ? `${d.host}: sent to sleep, idle for ${Math.round(d.idle)} s`
        : `${d.host}: sent to sleep by an operator`, ""];
    }
    if (type !== "host.wake") return null;
    if (d.stage === "begun") return [`${d.host}: waking (${d.why}), magic packet sent`, ""];
    if (d.stage === "done") return [`${d.host}: woke in ${Number(d.elapsed).toFixed(1)} s`, "ok"];
    return [`${d.host}: did not wake: ${d.reason}`, "bad"];
  }

  window.llmproxySleep = { badge, describe, eventTypes: ["host.sleep", "host.wake"] };
})();
