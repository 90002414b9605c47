"""The collector's freeze (`gc_freeze`): what the process holds when an engine (or a gateway) starts is moved out
of the collector's way, once per process.

    freeze_long_lived()     # the engine and the agents' gateway, as they start
"""

from __future__ import annotations

import gc

_frozen = False  # whether this process's long-lived objects have been frozen


def freeze_long_lived() -> None:
    """Once per process: collect garbage, then move every object alive into the collector's permanent generation
    (gc.freeze), which its full passes skip. A full pass stops the event loop for as long as it takes, and what the
    rollout process holds when an engine starts (modules, torch, the tokenizer) makes that 130-160 ms at every pass
    (benchmarks.longtail --no-gc-freeze); those objects live as long as the process anyway."""
    global _frozen
    if not _frozen:
        _frozen = True
        freeze_alive()


def freeze_alive() -> None:
    """Collect garbage, then freeze what is left alive (gc.freeze): the collector's passes skip it from then on."""
    gc.collect()
    gc.freeze()
