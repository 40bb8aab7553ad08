"""What every part may import; imports nothing of llmproxy and no twisted.web.

Modules:

- `events`: the frozen event records the hub carries.
- `hub`: the synchronous event hub (observers isolated from each other).
- `failures`: a failure described in one line for logs and errors.
- `clockwaits`: bounded waits on a clock, and values made once a second.
- `deadlines`: many deadlines on one timed call.
- `capacity`: the events of a host's capacity (queue, cordons, choices).
- `energy`: the events of energy (what an engine's start cost).
- `sleepwake`: the events of hosts that sleep and wake (host.sleep, host.wake).
- `kvcache`: the events of a kept prompt cache (saved, restored, failed).
- `tokens`: the event of a request's token timing (first token, gaps, rates).
- `traces`: the events of the trace exporter (a collector down, and back).
- `reactors`: the reactor's interfaces, grouped by what each part uses.
- `sourcedigest`: is the installed library the one some code follows?
- `text`: client-chosen strings shown bounded and escaped.
- `redact`: engine log text and client addresses withheld from all but operators.
- `pausedsend`: bytes to a streaming client as fast as it reads them (bounded).
"""
