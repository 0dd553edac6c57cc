"""A fleet client over real agents that keeps every frame it receives, and the frames of one type among them."""

from __future__ import annotations

from gridwatch.sshlink.client import Fleet, FleetOptions
from gridwatch.sshlink.hostlist import parse_endpoints
from gridwatch.wire import protocol as p


def make_fleet(ra_or_spec, keys, key=None, known=None, **opts):
    spec = ra_or_spec if isinstance(ra_or_spec, str) else ra_or_spec.spec
    frames: list[tuple[str, p.Frame]] = []
    fleet = Fleet(
        parse_endpoints(spec),
        FleetOptions(key_path=str(key or keys.operator_key), known_hosts=str(known or keys.known_hosts), backoff_min=0.05, backoff_max=0.3, **opts),
        on_frame=lambda link, f: frames.append((link.name, f)),
    )
    return fleet, frames


def of_type(frames, cls):
    return [f for _, f in frames if isinstance(f, cls)]
