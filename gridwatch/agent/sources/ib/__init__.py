"""InfiniBand and RoCE HCA ports: read from sysfs (or simulated), judged between samples, exported under node_exporter's names.

One job a module: :mod:`.ports` (what a port reading is, and where readings
come from), :mod:`.sysfs` (the real reader), :mod:`.simulated` (the sim-mode
reader), :mod:`.judge` (readings into wire samples and events), :mod:`.source`
(the agent source, and :func:`~.source.open_ib_source`), :mod:`.metrics`
(``node_infiniband_*`` for /metrics). Import each name from its module.
"""
