"""Start-up's heap, kept out of the garbage collector's full collections.

A full collection (Python's oldest generation) walks every object the collector
tracks, and the reactor waits for it: every event due meanwhile is late. What
start-up makes (modules, classes, functions, the config, the service's parts)
lives as long as the process, so once start-up is over, before the first accept,
it is collected once and frozen (`gc.freeze`): later full collections walk only
what came after. docs/performance.md has the measured effect on the lag.

Then full collections are made rarer: at most one every FULL_EVERY collections
of the middle generation (CPython's default is 10), besides CPython's own rule
that the objects awaiting a full collection be at least a quarter of those it
would walk. What triggers them under load is live streams' objects surviving
into the oldest generation (a burst of new streams makes thousands at once), and
each walks every live stream's objects while the reactor waits; cyclic garbage
that reached the oldest generation waits longer to be freed (the young
generations are collected as before).

Contract: an object frozen here that later becomes cyclic garbage is never
collected; what start-up makes lives as long as the process, or is freed by its
reference count.
"""

from __future__ import annotations

import gc

FULL_EVERY = 100


def freeze_startup_heap() -> int:
    """Collect, then freeze every object the collector tracks now, and make full
    collections rarer (FULL_EVERY); how many objects were frozen."""
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_EVERY)
    return gc.get_freeze_count()
