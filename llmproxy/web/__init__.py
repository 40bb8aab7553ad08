"""The HTTP face, on public Twisted (llmproxy/speedups/ holds the faster
paths). Imports `core`, `config`, `hosts` and `observe`; never `lifecycle`.

Modules:

- `site`: the Site and its requests (HTTP/2 connections known to it).
- `channel`: one HTTP/1.1 connection, every override of Twisted's `HTTPChannel` in one class.
- `requeststate`: one request's typed record (`request.state`), and its client's address.
- `streams`: an HTTP/2 stream judged from its headers (door, body limit, body timer).
- `cutoff`: a client cut off (dropped, or a body ended short) on HTTP/1.1 and HTTP/2.
- `timers`: how long the proxy waits for a client.
- `bodylimit`: a body over `max_body_bytes` refused as soon as the proxy knows (the request's part).
- `headerlimits`: the answers to request headers over the limits (431), a second Host (400).
- `paths`: the path table (each path's answer and methods), the page in memory.
- `routes`: the door and the dispatch by the path table.
- `turns`: new requests' set-ups, a slice per turn of the loop, so a burst of
  arrivals never holds the running streams' events back for long.
- `unread`: requests refused before the door (a body too large, a dot segment, a stalled body).
- `access`: inbound API keys at the door.
- `origin`: the Host names answered without a key, and the cross-site refusals.
- `ratelimit`: each key's requests and tokens per minute (`rpm`, `tpm`).
- `usage`: a request's tokens for `tpm`: its estimate, a stream's usage asked of the engine.
- `energybudget`: each key's GPU energy per day (`wh_per_day`).
- `energyhead`: a non-streamed answer's `X-LLMProxy-Energy-Joules`.
- `cors`: the origins whose pages may call the API paths.
- `admin`: the operator's actions and who may ask them from where.
- `hostlog`: an engine's log as Server-Sent Events (`/api/hosts/H/log`).
- `captures`: a request's capture started and kept, and `/api/captures` (capture on).
- `forward`: one API request forwarded to the engine that serves its model.
- `attempt`: one request's way through its model's hosts (replicas) and fallbacks.
- `upstreamcall`: one upstream request, its header timeout and its client leaving.
- `queuewait`: a request waiting in its host's queue.
- `multipart`: multipart bodies routed by their `model` field.
- `relay`: the engine's answer relayed to the client under backpressure.
- `enginesilence`: an engine silent in the middle of an answer (`engine_read_timeout_seconds`).
- `engineclient`: the reference HTTP client to the engines, on treq.
- `treqlayers`: the layer under treq's decoder: no content coding asked for or undone.
- `enginehead`: the rules an engine's response head is held to.
- `enginewatch`: the watch holding Twisted's client to those rules and llhttp's chunk framing.
- `credentials`: each host's own key upstream, never the client's.
- `errors`: OpenAI-style JSON error bodies.
- `errorbody`: the start of an engine's error answer, read within bounds.
- `anthropic`: the Anthropic Messages API's error shape.
"""
