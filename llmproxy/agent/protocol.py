"""The agent's wire protocol, one version for both ends: the agent (`main`) answers only
orders that carry it, and the proxy (llmproxy/hosts/agentclient.py) reads only answers and
events that carry it. Standard library only (it is imported on the GPU host too).

Protocol 4: every order the proxy sends names its host (``"host": NAME``, the config's host
name), and each host's engines, exits, logs, lock and lease live in a state directory of that
host's own (`state.host_dir`): hosts that share an ssh target never see each other's engines,
so engine names may repeat across them and each host's watch reports only its own exits.
"""

from __future__ import annotations

PROTOCOL = 4  # the orders, answers and events both ends speak
HOST_FIELD = "host"  # the order's field naming the proxy's host (a NAME, as engine names)
