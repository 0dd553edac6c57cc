"""When the console hands its long-lived objects to ``gc.freeze``, so the collector's full walks skip them.

A console holding thousands of links keeps ~150 objects per link (the SSH connection, its cipher,
streams, the node's state) for as long as the link lives. Left in the collector's oldest generation,
each full collection walks all of them: 250-500 ms a walk at 2,500 links, several a minute. Frozen,
they cost nothing. So the baseline is taken again (what is not frozen yet collected, then frozen) once
a tenth of the links (at least 50) came up since the last one, never twice within ``min_gap`` seconds.
But what is frozen is never collected: a link that drops later leaves its objects (cycles among them)
in the frozen set. So once as many links came up as the console holds (a whole fleet's worth of
reconnects), the baseline is taken afresh: everything unfrozen, collected, frozen again. What flapping
nodes leave behind is bounded by one fleet's worth of links and freed then; the full walk (a second or
so at 12,500 nodes) is paid that rarely, not at every baseline.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field

REBASE_SHARE = 0.1  # of the links: this many coming up since the last baseline take another
REBASE_MIN_UPS = 50
REBASE_MIN_GAP_S = 5.0


@dataclass
class CollectorBaseline:
    """Counts links coming up; takes a new frozen baseline when enough did (see the module's words)."""

    clock: Callable[[], float]
    links: int = 0  # links the console holds
    min_gap: float = REBASE_MIN_GAP_S
    ups: int = 0  # links that came up since the last baseline
    ups_since_fresh: int = 0  # ... since everything was last unfrozen and collected
    baselines: int = 0
    fresh: int = 0  # baselines taken afresh
    last_at: float | None = None
    # The collector's calls, injectable so a test can count them.
    unfreeze: Callable[[], None] = gc.unfreeze
    collect: Callable[[], int] = gc.collect
    freeze: Callable[[], None] = gc.freeze
    _pending: bool = field(default=False, repr=False)

    def link_up(self) -> None:
        """A link came up (connected after not being so)."""
        self.ups += 1
        self.ups_since_fresh += 1
        if self.ups >= max(REBASE_MIN_UPS, int(self.links * REBASE_SHARE)):
            self._pending = True
        self.tick()

    def settled(self) -> None:
        """Every link has been tried once: what lives now lives as long as the console."""
        self._pending = True
        self.tick()

    def tick(self) -> None:
        """Take the baseline asked for, unless one was taken less than ``min_gap`` ago (the runtime's tick calls this)."""
        if not self._pending:
            return
        now = self.clock()
        if self.last_at is not None and now - self.last_at < self.min_gap:
            return
        if self.ups_since_fresh >= max(self.links, REBASE_MIN_UPS):
            # Unfrozen first, so what died since (dropped links' cycles) is collected now.
            self.unfreeze()
            self.ups_since_fresh = 0
            self.fresh += 1
        self.collect()
        self.freeze()
        self.ups, self._pending, self.last_at = 0, False, now
        self.baselines += 1
