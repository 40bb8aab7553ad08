"""The agent run on a GPU host over ssh (`llmproxy-agent`, `python -m
llmproxy.agent`): starts, stops and reports the engines of its host, speaking
a versioned protocol with the proxy. Standard library only; imports nothing
else of llmproxy, so it runs from a bare install.

Modules:

- `main`: the command line, the protocol check, one JSON answer line per order.
- `orders`: the `status` and `stop` orders, and what every order shares.
- `start`: the `start` order: launch one engine, wait for its health.
- `state`: the state directory, one record per engine, the lock, the v1 migration.
- `processes`: the engines' process groups: alive, ours, ended.
"""
