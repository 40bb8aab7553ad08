"""What operators observe; imports `core`, `config` and `hosts`, never `web` or
`lifecycle`.

Modules:

- `inflight`: the record of each request in flight (`Exchange`, `InFlight`).
- `status`: the `/status` document.
- `eventstream`: `/api/events`, the event ring and its SSE subscribers.
- `metrics`, `capmetrics`, `keyusage`: Prometheus metrics from hub events.
- `tokentimes`, `tokenmetrics`: a stream's token timing, measured as it is
  relayed, and its metrics (time to first token, gaps, tokens per second).
- `tracing`: OpenTelemetry spans of the API requests, exported off the reactor
  (the config's `tracing`; the [otel] extra).
- `hostmetrics`: the managed hosts' watch, GPU and supervision gauges in `/metrics`.
- `energy`, `energymetrics`: the GPUs' measured energy by request, key, model
  and engine (idle, loading), and its figures in `/metrics`.
- `sleepmetrics`: the sleep state of hosts that sleep, their sleeps and wakes, in `/metrics`.
- `fastpaths`: what the start-up log and `/metrics` say of speedups and compat.
- `queueeta`, `queueview`: each host's queue with positions and ETAs (the
  waiting clients' comments, `/status`, `queue.update` events).
- `capture`, `captureredact`, `capturefiles`: the opt-in capture of requests and
  answers (a compressed ring in memory; what is redacted; the optional files).
- `page/`: the status page (HTML, JS, CSS).
"""
