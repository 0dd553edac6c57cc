"""The agent on SSH: its connections (keys from its config) and each session's stream of frames."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncssh
from loguru import logger

from gridwatch.agent.agent import Agent
from gridwatch.sshlink.server import READ_CHUNK, Gate, RoleKeyServer, SubsystemSession, admitted, subsystem_server_options
from gridwatch.wire import protocol as p
from gridwatch.wire.framing import LineBuffer


class _Server(RoleKeyServer):
    """An agent's connection: its keys' lists from its config, its session the agent's stream."""

    def __init__(self, agent: Agent, gate: Gate | None = None) -> None:
        super().__init__(gate or Gate(limit=agent.config.max_unauthenticated), str(agent.node))
        self.agent = agent

    def authorized(self) -> tuple[str, str]:
        return self.agent.config.authorized_operators, self.agent.config.authorized_viewers

    def session_requested(self) -> asyncssh.SSHServerSession:
        return SubsystemSession(lambda proc: _session(self.agent, proc), self)


async def _session(agent: Agent, process: asyncssh.SSHServerProcess) -> None:
    caller = admitted(process, "agent")
    if caller is None:
        return
    def close(last: bytes) -> None:
        # Queued behind what was already written; the channel closes once that is sent.
        try:
            process.stdout.write(last)
            process.exit(1)
        except (OSError, asyncssh.Error):
            pass

    client = agent.connect(caller, close)
    log = logger.bind(node=str(agent.node))
    log.info("client connected: {}", caller)
    process.stdout.write(agent.hello(caller.role))
    writer = asyncio.create_task(agent.write_loop(client, process.stdout.write, process.stdout.drain))
    pending: set[asyncio.Task[None]] = set()
    lines = LineBuffer()
    try:
        while True:
            data = await process.stdin.read(READ_CHUNK)
            if not data:
                break
            before = lines.oversized
            for line in lines.feed(data):
                work = agent.handle_request(client, line)
                if work is not None:
                    task = asyncio.ensure_future(work)
                    pending.add(task)
                    task.add_done_callback(pending.discard)
            if lines.oversized != before:
                client.reply(agent.reply_frame(p.Error(code=p.Text("too_large"), message=p.Text(f"request over {p.MAX_FRAME_BYTES} bytes dropped"))))
    except (asyncssh.BreakReceived, asyncssh.SignalReceived, asyncssh.TerminalSizeChanged):
        pass
    except (asyncssh.DisconnectError, ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        agent.forget(client)
        for task in pending:
            task.cancel()
        writer.cancel()
        log.info("client gone: {} ({} replies dropped)", caller, client.dropped)
        try:
            process.exit(0)
        except (OSError, asyncssh.Error):
            pass


async def serve(agent: Agent, host: str, port: int) -> asyncssh.SSHAcceptor:
    """Listen for consoles; returns the acceptor (``.close()`` to stop, ``.sockets`` for the port).

    A node without a host key makes its own on first start (ed25519, 0600), so
    no two nodes share one unless an operator chose to; consoles pin it with
    ``gridwatch keys trust``.
    """
    if not Path(agent.config.host_key).exists():
        from gridwatch.sshlink.keys import make_host_key

        try:
            made = make_host_key(agent.config.host_key, comment=f"gridwatch-agent-{agent.node}")
        except OSError as exc:
            raise RuntimeError(f"cannot create the agent host key {agent.config.host_key}: "
                               f"{exc.strerror or exc}") from None
        logger.bind(node=str(agent.node)).info(
            "made a new host key {} ({}); pin it on the console with: gridwatch keys trust HOST:PORT",
            agent.config.host_key, made.get_fingerprint())
    try:
        host_key = asyncssh.read_private_key(agent.config.host_key)
    except (OSError, asyncssh.KeyImportError) as exc:
        raise RuntimeError(f"cannot read the agent host key {agent.config.host_key}: {exc}") from None
    gate = Gate(limit=agent.config.max_unauthenticated)
    return await asyncssh.create_server(lambda: _Server(agent, gate), host, port, server_host_keys=[host_key],
                                        **subsystem_server_options(agent.config.login_timeout))
