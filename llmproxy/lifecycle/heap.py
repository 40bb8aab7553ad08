"""The heap start-up leaves behind, kept out of the garbage collector's full collections.

A full collection (Python's oldest generation) walks every object the collector
tracks, and the reactor waits for it. After start-up that is about 52,000 objects
(modules, classes, functions, the config, the service's parts), all of them alive
as long as the process; streams in flight add their own. With 200 streams a full
collection took 40 to 60 ms here, and every event due meanwhile waited: in `make
bench`'s paced phase the events' lag p99 went up to 16.9 ms (its budget is 5 ms) in
the runs where one landed there. Once start-up is over, before the first accept,
what it made is collected once and frozen (`gc.freeze`): later full collections
walk only what came after (11 to 19 ms in the same phase, where that run's lag
p99 was 0.95 ms).
An object frozen there that later becomes cyclic garbage is never collected; what
start-up makes lives as long as the process, or is freed by its reference count.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze every object the collector tracks now; how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
