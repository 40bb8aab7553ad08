"""The GPU hosts: what each serves (`roster`), public names joined with the
rosters (`catalog`), one managed host's engine (`manager`), all of them with
their locks and idle stop (`fleet`, `locks`, `idle`), and the ssh transport to
the agent (`agentclient`). Imports `core` and `config`; never `web`, `observe`
or `lifecycle`, and no request records: it publishes events instead."""
