"""What operators observe: the record of each request in flight (`requests`),
the log lines made from hub events (`logview`), and the `/status` document
(`status`). Imports `core`, `config` and `hosts`; never `web` or `lifecycle`."""
