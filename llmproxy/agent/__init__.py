"""The agent run on a GPU host over ssh (`llmproxy-agent`, `python -m
llmproxy.agent`): starts, stops and reports the engines of its host, speaking
a versioned protocol with the proxy. Standard library only; imports nothing
else of llmproxy, so it runs from a bare install.

Modules:

- `protocol`: the wire, shared with the proxy: the version, the orders' and events' names,
  how an exit is said, and the one decode of an event line into a typed record.
- `main`: the command line, the protocol check, each host's state directory, one JSON
  answer line per order (or a stream of event lines for `watch` and `log`).
- `orders`: the `status` and `stop` orders, and what every order shares.
- `sleep`: the `sleep` order: the host's suspend command, once no engine of it lives.
- `start`: the `start` order: launch one engine under its reaper, wait for its health.
- `kvcache`: a kept prompt cache: an engine's llama-server slots saved before a stop the
  proxy chose and restored at its next start, the files bounded.
- `reaper`: the leader of an engine's process group: runs it, records how it ended.
- `exits`: engine exits known once and told once, kept apart from the agent's own stops.
- `watch`: the `watch` order: exits, health, GPU figures and ticks as JSON lines.
- `gpus`: the GPUs' figures, read from nvidia-smi.
- `logs`: engine logs: tails, rotation while the engine writes, the `log` order.
- `lease`: the host's lease: which proxy manages it, held by that proxy's watch.
- `state`: the state directory, one record per engine, the lock, the v1 migration.
- `processes`: the engines' process groups: alive, ours, ended.
"""
