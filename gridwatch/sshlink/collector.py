"""The garbage collector of a process that reads many links: its youngest objects collected 10,000 at a time.

CPython walks its youngest generation whenever 700 more container objects are alive than at its last walk.
A console's redraw, or a pass over a few hundred links' frames, holds more than that for a moment: at 1,000
nodes the console walked them about once a second, each walk bringing those objects back into the caches
just before their reference counts freed nearly all of them anyway. At 10,000 such moments never reach the
threshold; what is left to collect is the cyclic garbage, at most that many objects held a little longer.
The oldest generation is the console's own business: it freezes what lives as long as it once its links are
up (gridwatch/console/runtime/collector.py), so its full walks skip them.
Measured with benchmarks/bench_console_scale.py at 1,000 nodes (BENCHMARKS.md, issue 25's sixth round).
"""

from __future__ import annotations

import gc

YOUNG_OBJECTS = 10_000  # CPython's default is 700


def collect_less_often() -> None:
    """Walk the youngest generation every :data:`YOUNG_OBJECTS` objects; the older generations as before."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_OBJECTS, older, oldest)
