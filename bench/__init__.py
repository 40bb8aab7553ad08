"""`make bench`: llmproxy measured side by side with a direct connection and nginx.

The parts: `engine` (a fast OpenAI-shaped upstream, run as its own process), `client`
(the asyncio load generator), `targets` (starting and measuring the processes),
`scenarios` (the figures), `stats` and `budgets` (pure arithmetic, unit-tested),
`report` (the table and the JSON) and `cli` (`python -m bench`).
"""
