"""The agent run on a GPU host over ssh (`llmproxy-agent`, `python -m
llmproxy.agent`): starts, stops and reports one engine. Standard library only;
imports nothing else of llmproxy, so it runs from a bare install.

Modules:

- `main`: the agent's orders (`start`, `status`, `stop`), one JSON answer line each.
"""
