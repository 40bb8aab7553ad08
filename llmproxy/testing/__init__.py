"""Test doubles, the simulated engine and the demo built on it. Production
code never imports this package (the demo only for `twistd llmproxy --demo`).
Nothing is imported here: `tap` imports `demo` only when asked.

Modules:

- `fakes`: a fake upstream client, and HTTP to a Site in memory.
- `upgradefakes`: a process reactor whose upgrade candidates are ready at once, and a
  hand-over run through it.
- `agentfakes`: a fake agent transport, the agent's answers, a fake process reactor.
- `simengine`: a simulated OpenAI-compatible engine.
- `simanswers`: what the simulated engine answers with, and its `X-Sim-*` controls.
- `simextra`: more of llama-server in it (Anthropic, audio, `--api-key`, https, a health
  that fails on demand: `--health-file`, `--hang-after`).
- `simslots`: llama-server's slot save/restore API in it (`--slot-save-path`), and
  `timings.prompt_n`.
- `nvidiasmi`: a fake `nvidia-smi` for the agent's GPU telemetry.
- `crashengine`: an engine that exits soon after its first health check (supervision tests).
- `simserve`: its command line (`llmproxy-simengine`).
- `demo`: the built-in demo's config and engines.
"""
