"""The GPU hosts. Imports `core` and `config`; never `web`, `observe` or
`lifecycle`, and no request records: it publishes events instead.

Modules:

- `roster`: what each host serves, its `GET /v1/models` read in generations.
- `catalog`: public model names, one config snapshot joined with the rosters.
- `host`: one host as the proxy uses it (`Host`), its parts composed.
- `scheduler`: one host's queue and slots (`Scheduler`): waiters, priority, fairness.
- `placement`: what a scheduler asks what to start (`IPlacement`), one engine at a time.
- `budget`: the placement policy of a host with a memory budget (`MemoryBudget`).
- `controller`: a managed host's agent calls and the engine state they learn.
- `agentcalls`: the orders of those calls, their timeouts, their answers read.
- `kvreport`: what the agent's answers say of kept prompt caches, published as events.
- `adoption`: which engines found running a host adopts (pure).
- `priority`: the order of a queue's waiters by their key's priority class.
- `batching`: the queue's rule for several engines' requests (`schedule`: batch, arrival).
- `waiter`: a request waiting in a queue, its lease, the one a full queue gives up.
- `queueerrors`: the ways a wait in a queue ends without a lease (full, timed out, ...).
- `residency`: the eviction rule of a budgeted host (which idle engines make room).
- `choose`: which replica serves a request for a model several hosts serve.
- `siting`: where an engine that runs nowhere starts among its hosts, room reserved.
- `prefixring`: automatic prefix affinity, bounded-load consistent hashing (pure).
- `fleet`: every host's queue together, with the locks, idle stop and agent transport.
- `cordons`: cordons that outlive the process (`cordons.json`), and on each host.
- `measured`: the engines' measured GPU memory (`memory.json`), which placement counts.
- `sleepwake`: one host that sleeps when idle and wakes on demand (`SleepWake`).
- `naps`: the fleet's hosts that sleep and wake, their sleep timer, the operator's commands.
- `magic`: Wake-on-LAN magic packets, sent by UDP broadcast through the reactor.
- `idle`: an engine stopped after `idle_stop_seconds` without a request.
- `locks`: a flock per managed ssh target, one proxy per host on a machine.
- `lease`: the hosts' leases as this proxy sees them, the standby's wait for them.
- `agentclient`: the ssh transport to a host's `llmproxy-agent`.
- `agentprocess`: one agent call's process: the order in, its answer read (or why none).
- `agentbundle`: the agent this proxy brings to a host over ssh (nothing to install there).
- `agentstream`: a long-lived agent call (`watch`, `log`), its JSON lines as they come.
- `watch`: each managed host's watch session, reopened with backoff.
- `enginelogs`: an engine's log read over ssh (the agent's `log` order).
- `supervisor`: one host's engines supervised: crashes forgotten, restarted, `failed`.
- `supervise`: the supervision rules (backoff, crash loop, hung engine).
"""
