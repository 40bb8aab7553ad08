"""`make bench`: llmproxy measured side by side with a direct connection and nginx.

llmproxy runs twice: with its speedups (`llmproxy`) and on the reference path alone
(`llmproxy-reference`, LLMPROXY_SPEEDUPS=0), each held to its own budgets; `--without
NAME` adds llmproxy without one speedup, to show its gain. The parts: `engine` (a fast
OpenAI-shaped upstream, run as its own process), `client` (the asyncio load generator),
`targets` (starting and measuring the processes), `proxies` (llmproxy in each mode,
checked by its /status), `scenarios` (the figures), `stats` and `budgets` (pure
arithmetic, unit-tested), `report` (the table and the JSON) and `cli` (`python -m bench`).
"""
