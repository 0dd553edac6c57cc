"""Ask the node's NCCL RAS service (NCCL 2.24+, port 28028) which ranks it sees as dead or missing.

Every NCCL 2.24+ process runs a RAS thread; the one on 127.0.0.1:28028 (the
job's NCCL_RAS_ADDR) answers a small text protocol: the client sends
``CLIENT PROTOCOL <n>``, the server answers ``SERVER PROTOCOL <n>``, then
``STATUS`` (or ``VERBOSE STATUS``) makes it write a report and close the
connection (NVIDIA/nccl src/ras/client.cc, client_support.cc). The report's
"Errors" section names processes ``DEAD`` (unreachable over the RAS network),
job processes whose data is missing (``INCOMPLETE``), and per communicator
the ranks that did not answer (``#<group>-<index> (<hash>) INCOMPLETE``) or
whose status differs (``MISMATCH``, under "Warnings"). Those lines are what is
parsed here; the rest of the report is kept as text for the operator.
"""

from __future__ import annotations

import asyncio
import re
import socket

from loguru import logger

from gridwatch.wire.protocol import clean_text
from gridwatch.wire.ras import RasCommunicator, RasRank, RasReport, RasState

DEFAULT_ADDR = "127.0.0.1:28028"
PROTOCOL = 2  # NCCL_RAS_CLIENT_PROTOCOL in src/ras/ras_internal.h
MAX_REPLY = 1 << 20  # a report past this is cut: a large job's report is a few KiB unless verbose
MAX_KEPT_LINES = 400  # report lines kept for the operator


class RasUnavailable(Exception):
    """The RAS service answered, but not with a report we can use (one sentence, for the operator)."""


_COMM = re.compile(r"^#(\d+-\d+) \(([0-9a-fA-F]+)\) (INCOMPLETE|ERROR|MISMATCH)$")
_PROCESS = re.compile(r"^Process (\d+) on node (\S+) managing GPUs? (.+)$")
_RANK_AT = re.compile(r"^Rank (\d+)(?: (.*?))? -- GPU (.+?) managed by process (\d+) on node (\S+)$")
_RANK_UNKNOWN = re.compile(r"^Rank (\d+)(?: (.*?))? -- \[process information not found\]$")


def parse(text: str, complete: bool = True) -> RasReport:
    """The report in ``text`` (a RAS STATUS reply), typed; lines it does not know are kept as text, never raised on."""
    lines = [clean_text(line.rstrip("\r")) for line in text.split("\n")]
    report = RasReport(complete=complete, text=lines[:MAX_KEPT_LINES])
    section = ""  # "", "errors", "warnings"
    block = ""  # the headline the indented lines belong to: DEAD, INCOMPLETE, TIMEOUT, or a communicator's
    comm: RasCommunicator | None = None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        if line.startswith("NCCL version ") and not report.version:
            report.version = line.strip()
            continue
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if line in ("Errors", "Warnings") and following and set(following) == {"="}:
            section, block, comm = line.lower(), "", None
            continue
        if set(line) == {"="}:
            continue
        if not line.startswith(" "):
            if section:
                (report.errors if section == "errors" else report.warnings).append(line.strip())
            match = _COMM.match(line.strip())
            if section and match:
                comm = RasCommunicator(label=f"#{match[1]}", hash=match[2].lower(), problem=match[3])
                report.communicators.append(comm)
                block = match[3]
            else:
                comm, block = None, line.strip() if section else ""
            continue
        if not section or not block:
            continue
        body = line.strip()
        state = RasState.MISMATCH if block == "MISMATCH" else RasState.DEAD if block == "DEAD" else RasState.MISSING
        if comm is None:
            if block not in ("DEAD", "INCOMPLETE"):
                continue
            proc = _PROCESS.match(body)
            if proc:
                report.processes.append(RasRank(state=state, pid=int(proc[1]), node=proc[2], gpu=proc[3]))
            continue
        at, unknown = _RANK_AT.match(body), _RANK_UNKNOWN.match(body)
        if at:
            comm.ranks.append(RasRank(state=state, rank=int(at[1]), detail=at[2] or "", gpu=at[3], pid=int(at[4]),
                                      node=at[5]))
        elif unknown:
            comm.ranks.append(RasRank(state=state, rank=int(unknown[1]), detail=unknown[2] or ""))
        else:
            comm.notes.append(body)  # "Missing communicator data from 1 rank", "3 ranks have status RUNNING"
    return report


def split_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets) as a pair; raises ValueError with the sentence an operator reads."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"ras: expected HOST:PORT with a port from 1 to 65535, got {addr!r}")
    return host.strip("[]"), int(port)


async def status(addr: str = DEFAULT_ADDR, timeout: float = 5.0, verbose: bool = False,
                 max_reply: int = MAX_REPLY) -> RasReport | None:
    """The RAS service's report at ``addr``; None when nothing listens there (no RAS on this node).

    Raises :class:`RasUnavailable` when something answers but not as RAS does,
    or says nothing within ``timeout``. A reply cut by ``max_reply`` or by the
    timeout after some text is parsed and marked incomplete.
    """
    host, port = split_addr(addr)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    def left() -> float:
        return max(0.0, deadline - loop.time())

    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=max_reply), left())
    except (ConnectionRefusedError, ConnectionResetError):
        return None
    except TimeoutError:
        raise RasUnavailable(f"the RAS service at {addr} did not accept a connection within {timeout:g} s") from None
    except OSError as exc:
        if exc.errno in (111, 99, 101, 113):  # refused, no such address, network or host unreachable
            return None
        raise RasUnavailable(f"cannot reach the RAS service at {addr}: {exc.strerror or exc}") from None
    try:
        writer.write(f"CLIENT PROTOCOL {PROTOCOL}\n".encode())
        await writer.drain()
        try:
            hello = await asyncio.wait_for(reader.readline(), left())
        except TimeoutError:
            raise RasUnavailable(f"the RAS service at {addr} did not answer within {timeout:g} s") from None
        except ValueError:
            raise RasUnavailable(f"the service at {addr} answered a line too long to be RAS's") from None
        said = clean_text(hello.decode(errors="replace").strip(), 200)
        if not said.upper().startswith("SERVER PROTOCOL "):
            raise RasUnavailable(f"the service at {addr} is not NCCL's RAS: it answered {said!r}" if said
                                 else f"the service at {addr} closed the connection without a RAS handshake")
        if said.split()[-1] != str(PROTOCOL):
            logger.debug("RAS at {} speaks protocol {}; asking anyway", addr, said.split()[-1])
        writer.write(b"VERBOSE STATUS\n" if verbose else b"STATUS\n")
        await writer.drain()
        chunks: list[bytes] = []
        size, complete = 0, True
        while True:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), left())
            except TimeoutError:
                if not chunks:
                    raise RasUnavailable(f"the RAS service at {addr} sent no report within {timeout:g} s") from None
                complete = False
                break
            if not chunk:
                break  # the server closes the connection after the report
            chunks.append(chunk[: max_reply - size])
            size += len(chunks[-1])
            if size >= max_reply:
                complete = False
                break
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise RasUnavailable(f"the RAS service at {addr} dropped the connection: {exc}") from None
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except (OSError, TimeoutError):
            pass
    text = b"".join(chunks).decode(errors="replace")
    if text.startswith("ERROR:"):
        raise RasUnavailable(f"the RAS service at {addr} refused the status request: {clean_text(text.strip(), 200)}")
    return parse(text, complete)


def _addresses() -> list[str]:
    name = socket.gethostname()
    out = [name]
    try:
        out += [str(info[4][0]) for info in socket.getaddrinfo(name, None)]
    except OSError:
        pass
    return list(dict.fromkeys(out))


async def local_addresses(timeout: float = 1.0) -> list[str]:
    """This host's name and the addresses it resolves to: how a console tells which node a RAS host line means."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(_addresses), timeout)
    except TimeoutError:  # a resolver that hangs: the name alone
        return [socket.gethostname()]
