"""A fleet client over real agents that keeps every frame it receives, the frames of one type among them, and an
agent of the test's own (a broken or hostile one) on a real SSH server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncssh

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


class AnyKeyServer(asyncssh.SSHServer):
    """An SSH server that takes any key: the test is about what is said, not who may ask."""

    def begin_auth(self, username: str) -> bool:
        return True

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        return True


async def fake_agent(keys: Any, script: Any, host_key: Any = None, server: type[asyncssh.SSHServer] = AnyKeyServer,
                     **options: Any) -> asyncssh.SSHAcceptor:
    """An SSH server of the test's own that speaks whatever ``script`` writes: a broken or hostile agent.

    It takes any key (``server``); its host key is the fleet's; ``options`` go to asyncssh.create_server.
    """
    return await asyncssh.create_server(server, "127.0.0.1", 0, server_host_keys=[host_key or str(keys.host_key)],
                                        process_factory=script, encoding=None, **options)


@asynccontextmanager
async def fleet_of_one(keys: Any, script: Any, ssh_client: str = "auto",
                       **options: Any) -> AsyncIterator[tuple[Fleet, list[Any], Any]]:
    """A fleet linked to one :func:`fake_agent` (``options`` go to it): the fleet, its frames and its link."""
    server = await fake_agent(keys, script, **options)
    fleet, frames = make_fleet(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", keys, ssh_client=ssh_client)
    await fleet.start()
    try:
        yield fleet, frames, next(iter(fleet.links.values()))
    finally:
        await fleet.stop()
        server.close()
