"""A hostile peer at a node's address: speaks just enough SSH to send a disconnect reason full of escapes.

Anything listening where a node should be can answer before its host key is
checked. This peer sends its version line, reads the client's, and then sends
an unencrypted ``SSH_MSG_DISCONNECT`` (allowed before key exchange) whose
reason carries terminal escapes. It runs in a thread, so an asyncio test and a
CLI started as a subprocess can both connect to it.

    with hostile_peer() as peer:
        ... connect to 127.0.0.1:peer.port ...
        assert peer.connections >= 1

``ESCAPES`` is what it sends; :func:`contains_escape` says whether any of it could
still act on a terminal. None of it may reach a terminal, a log line or the state.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

ESC = "\x1b"
# OSC 0 sets the terminal title; CSI 2 J clears the screen; OSC 52 writes the clipboard.
OSC_TITLE = f"{ESC}]0;pwned\x07"
CSI_CLEAR = f"{ESC}[2J"
OSC_CLIPBOARD = f"{ESC}]52;c;cHduZWQ=\x07"
ESCAPES = OSC_TITLE + CSI_CLEAR + OSC_CLIPBOARD
DEFAULT_REASON = f"go away {OSC_TITLE}{CSI_CLEAR}{OSC_CLIPBOARD} now"

SSH_MSG_DISCONNECT = 1
SSH_DISCONNECT_PROTOCOL_ERROR = 2


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def disconnect_packet(reason: str, code: int = SSH_DISCONNECT_PROTOCOL_ERROR) -> bytes:
    """One unencrypted SSH binary packet (RFC 4253 section 6) carrying SSH_MSG_DISCONNECT."""
    payload = bytes([SSH_MSG_DISCONNECT]) + struct.pack(">I", code) + _string(reason.encode("utf-8", "surrogateescape")) + _string(b"en")
    # Cipher "none" has block size 8; padding is at least 4 bytes.
    pad = 8 - (5 + len(payload)) % 8
    if pad < 4:
        pad += 8
    return struct.pack(">IB", 1 + len(payload) + pad, pad) + payload + b"\0" * pad


@dataclass
class HostilePeer:
    """A running hostile peer: where it listens and how many clients it has answered."""

    port: int
    reason: str
    host: str = "127.0.0.1"
    connections: int = 0
    client_versions: list[bytes] = field(default_factory=list)

    @property
    def spec(self) -> str:
        return f"{self.host}:{self.port}"


def _serve_one(conn: socket.socket, peer: HostilePeer, version: bytes, pre_lines: list[bytes]) -> None:
    with conn:
        conn.settimeout(5.0)
        try:
            # RFC 4253 allows other lines before the version line; clients may show them.
            for line in pre_lines:
                conn.sendall(line + b"\r\n")
            conn.sendall(version + b"\r\n")
            got = b""
            while b"\n" not in got and len(got) < 1024:
                chunk = conn.recv(1024)
                if not chunk:
                    break
                got += chunk
            peer.client_versions.append(got.split(b"\n", 1)[0].rstrip(b"\r"))
            conn.sendall(disconnect_packet(peer.reason))
            # Let the client read the packet before the close.
            conn.shutdown(socket.SHUT_WR)
            while conn.recv(4096):
                pass
        except OSError:
            pass


@contextmanager
def hostile_peer(
    reason: str = DEFAULT_REASON,
    *,
    version: str = "SSH-2.0-OpenSSH_9.6",
    pre_lines: tuple[str, ...] = (),
    port: int = 0,
) -> Iterator[HostilePeer]:
    """Listen on loopback; every client gets ``version`` and then a disconnect with ``reason``.

    ``version`` and ``pre_lines`` may carry escapes too (a hostile banner).
    """
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(16)
    sock.settimeout(0.1)
    peer = HostilePeer(port=sock.getsockname()[1], reason=reason)
    stop = threading.Event()
    encoded_version = version.encode("utf-8", "surrogateescape")
    encoded_lines = [line.encode("utf-8", "surrogateescape") for line in pre_lines]

    def accept_loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            peer.connections += 1
            threading.Thread(target=_serve_one, args=(conn, peer, encoded_version, encoded_lines), daemon=True).start()

    thread = threading.Thread(target=accept_loop, daemon=True)
    thread.start()
    try:
        yield peer
    finally:
        stop.set()
        thread.join(timeout=2)
        sock.close()


def contains_escape(text: str) -> bool:
    """True when ``text`` could still act on a terminal: an ESC, a BEL, any other C0 control but
    newline and tab, DEL or a C1 control. Cleaned text keeps the harmless rest (``]0;pwned``)."""
    return any(ord(c) < 0x20 and c not in "\n\t" or 0x7F <= ord(c) <= 0x9F for c in text)
