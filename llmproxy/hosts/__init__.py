"""The GPU hosts. Imports `core` and `config`; never `web`, `observe` or
`lifecycle`, and no request records: it publishes events instead.

Modules:

- `roster`: what each host serves, its `GET /v1/models` read in generations.
- `catalog`: public model names, one config snapshot joined with the rosters.
- `queue`: one host's queue and slots (`HostQueue`), the one rule for waiting.
- `priority`: the order of a queue's waiters by their key's priority class.
- `waiter`: a request waiting in a queue, and the one a full queue gives up for a higher class.
- `queueerrors`: the ways a wait in a queue ends without a lease (full, timed out, ...).
- `manager`: a managed host's engine and the switches between engines (`HostManager`).
- `resident`: a budgeted host's engines, resident together (`ResidentHostManager`).
- `residency`: the eviction rule of a budgeted host (which idle engines make room).
- `choose`: which replica serves a request for a model several hosts serve.
- `prefixring`: automatic prefix affinity, bounded-load consistent hashing (pure).
- `fleet`: every host's queue together, with the locks, idle stop and agent transport.
- `cordons`: cordons that outlive the process (`cordons.json`).
- `idle`: an engine stopped after `idle_stop_seconds` without a request.
- `locks`: a flock per managed ssh target, one proxy per host on a machine.
- `lease`: the hosts' leases as this proxy sees them, the standby's wait for them.
- `agentclient`: the ssh transport to a host's `llmproxy-agent`.
- `agentbundle`: the agent this proxy brings to a host over ssh (nothing to install there).
- `agentstream`: a long-lived agent call (`watch`, `log`), its JSON lines as they come.
- `watch`: each managed host's watch session, reopened with backoff.
- `enginelogs`: an engine's log read over ssh (the agent's `log` order).
- `supervisor`: one host's engines supervised: crashes forgotten, restarted, `failed`.
- `supervise`: the supervision rules (backoff, crash loop, hung engine).
"""
