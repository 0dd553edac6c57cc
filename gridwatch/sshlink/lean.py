"""An agent's link with its packets read in C: libssh2 (through ssh2-python) under the same LineStream.

A console, and a relay, hold one link per node and receive a small message on each every few seconds.
asyncssh parses, decrypts and dispatches every packet in Python: 32-35 µs of the reader's CPU per message
at 500 links on loopback, read together every 0.1 s; libssh2 does the same in C for 17.5 µs
(benchmarks/bench_ssh_message.py, ``lean`` against ``callback@0.1+kept``). This module opens such a link
with the checks asyncssh's connection makes for us:

- the algorithms of :mod:`gridwatch.sshlink.policy` that libssh2 has (AES-GCM first, no SHA-1, strict kex);
- the host key against ``known_hosts``, read by asyncssh's own reader (one definition of which keys a host
  may show, hashed names and revoked keys included), before our key is offered;
- our key, given as asyncssh read it.

Failures are raised as the asyncssh errors they correspond to, so :func:`gridwatch.sshlink.links.explain`
says the same sentence whichever library carried the link. Only agents' links come here: a relay's link
(a handful, with keepalives) stays on asyncssh. Without ssh2-python installed, :data:`AVAILABLE` is False and
every link is asyncssh's; ``GRIDWATCH_SSH_CLIENT=asyncssh`` (in a unit's ``Environment=``) makes it so on purpose.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

import asyncssh
from asyncssh.public_key import decode_ssh_public_key

from gridwatch.sshlink.hostlist import Endpoint
from gridwatch.sshlink.links import weak_host_key
from gridwatch.sshlink.policy import ENCRYPTION_ALGS, KEX_ALGS, MAC_ALGS, SIGNATURE_ALGS, weak_key_reason
from gridwatch.sshlink.stream import LineStream

try:
    from ssh2 import session as _ssh2_session
    from ssh2.error_codes import LIBSSH2_ERROR_EAGAIN
    from ssh2.exceptions import AuthenticationError, PublickeyUnverifiedError, SSH2Error

    AVAILABLE = True
except ImportError:  # an install without the compiled library: asyncssh carries every link
    AVAILABLE = False
    LIBSSH2_ERROR_EAGAIN = -37

    class SSH2Error(Exception):  # type: ignore[no-redef]  # stand in so the except clauses still read
        pass

    class AuthenticationError(SSH2Error):  # type: ignore[no-redef]
        pass

    class PublickeyUnverifiedError(SSH2Error):  # type: ignore[no-redef]
        pass


class Unexplained(ConnectionError):
    """libssh2 could not open the link and cannot say why in the far end's words (a disconnect's reason is not
    kept): the caller tries once with asyncssh, which hears and quotes it."""


CLIENT_ENV = "GRIDWATCH_SSH_CLIENT"
CLIENTS = ("asyncssh", "libssh2")  # libssh2 (the default): agents' links in C where installed; asyncssh: every link
READ_SIZE = 65536  # a read takes what the socket holds: many frames after a pause, one in steady state
STDERR_SIZE = 4096
_EXTENDED_STDERR = asyncssh.EXTENDED_DATA_STDERR


def ssh_client(environ: Mapping[str, str] | None = None) -> str:
    """Who reads the agents' links: ``GRIDWATCH_SSH_CLIENT`` when set, else "libssh2"; ValueError in one line."""
    text = (os.environ if environ is None else environ).get(CLIENT_ENV, "").strip()
    if not text:
        return "libssh2"
    if text not in CLIENTS:
        raise ValueError(f"{CLIENT_ENV}: expected one of {', '.join(CLIENTS)}, got {text!r}")
    return text


def _prefs(session: Any) -> None:
    """Offer policy.py's algorithms that this libssh2 has, in policy.py's order."""
    s = _ssh2_session
    wanted = {
        s.LIBSSH2_METHOD_KEX: [*KEX_ALGS, "ext-info-c", "kex-strict-c-v00@openssh.com"],
        s.LIBSSH2_METHOD_HOSTKEY: list(SIGNATURE_ALGS),
        s.LIBSSH2_METHOD_CRYPT_CS: list(ENCRYPTION_ALGS),
        s.LIBSSH2_METHOD_CRYPT_SC: list(ENCRYPTION_ALGS),
        s.LIBSSH2_METHOD_MAC_CS: list(MAC_ALGS),
        s.LIBSSH2_METHOD_MAC_SC: list(MAC_ALGS),
    }
    for method, algs in wanted.items():
        have = set(session.supported_algs(method))
        session.method_pref(method, ",".join(a for a in algs if a in have))


class _Descriptor:
    """A link's socket as libssh2's session holds it, closed when that session is freed (it holds this), not before.

    libssh2 writes to the socket as it frees a channel (its close) and may read: were the descriptor closed
    first, a new connection given the same number would receive those bytes and fail its MAC check.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def __del__(self) -> None:
        self.sock.close()


class LeanConnection:
    """One node's SSH connection and its gridwatch channel, read by callback whenever its socket is readable.

    What :class:`gridwatch.sshlink.client.Fleet` needs of a connection: :meth:`close` and
    :meth:`get_server_host_key`; the channel's side (``write``, ``close``) is what its :class:`LineStream` writes to.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._fd = sock.fileno()
        self._held: _Descriptor | None = _Descriptor(sock)  # the session's from its handshake on; it closes the socket
        self._session: Any = _ssh2_session.Session()
        self._session.set_blocking(False)
        self._chan: Any = None
        self._stream: LineStream | None = None
        self._host_key: asyncssh.SSHKey | None = None
        self._out = bytearray()
        self._writer_on = False
        self._reread = False  # a read is due on the loop's next turn (see _flush)
        self._closed = False

    # ------------------------------------------------------------ opening

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` until libssh2 stops asking to wait, waiting on the socket the way it asks."""
        while True:
            if self._closed:
                raise ConnectionError("the connection was closed while it opened")
            result = fn(*args)
            if not (isinstance(result, int) and result == LIBSSH2_ERROR_EAGAIN):
                return result
            await self._socket_ready()

    async def _socket_ready(self) -> None:
        directions = self._session.block_directions()
        ready: asyncio.Future[None] = self._loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        inbound = bool(directions & _ssh2_session.LIBSSH2_SESSION_BLOCK_INBOUND) or not directions
        outbound = bool(directions & _ssh2_session.LIBSSH2_SESSION_BLOCK_OUTBOUND)
        if inbound:
            self._loop.add_reader(self._fd, wake)
        if outbound:
            self._loop.add_writer(self._fd, wake)
        try:
            await ready
        finally:
            if inbound:
                self._loop.remove_reader(self._fd)
            if outbound:
                self._loop.remove_writer(self._fd)

    async def open(self, endpoint: Endpoint, *, username: str, key: asyncssh.SSHKey, known_hosts: str,
                   subsystem: str) -> LineStream:
        """Handshake, check the host key, authenticate, open ``subsystem``: its stream, read from now on."""
        try:
            return await self._open(endpoint, username=username, key=key, known_hosts=known_hosts,
                                    subsystem=subsystem)
        except BaseException:
            self.close()  # the channel closed and the socket shut now, not when the failure's traceback is freed
            raise

    async def _open(self, endpoint: Endpoint, *, username: str, key: asyncssh.SSHKey, known_hosts: str,
                    subsystem: str) -> LineStream:
        session = self._session
        _prefs(session)
        try:
            await self._call(session.handshake, self._held)
        except SSH2Error as exc:
            raise Unexplained(f"handshake: {_why(exc)}") from None
        blob, _kind = session.hostkey()
        self._host_key = decode_ssh_public_key(bytes(blob))
        self._check_host_key(endpoint, known_hosts)
        try:
            await self._call(session.userauth_publickey_frommemory, username, key.export_private_key("openssh"))
        except AuthenticationError:  # the agent's USERAUTH_FAILURE to our key
            raise asyncssh.PermissionDenied("publickey authentication failed") from None
        except SSH2Error as exc:
            # PublickeyUnverifiedError too: libssh2 says so of any transport failure while it waits for the answer.
            raise Unexplained(f"authentication: {_why(exc)}") from None
        if not session.userauth_authenticated():
            raise asyncssh.PermissionDenied("publickey authentication failed")
        try:
            self._chan = await self._call(session.open_session)
            await self._call(self._chan.subsystem, subsystem)
        except SSH2Error as exc:
            raise Unexplained(f"the gridwatch channel: {_why(exc)}") from None
        stream = LineStream()
        stream.connection_made(self)
        self._stream = stream
        self._loop.add_reader(self._fd, self._readable)
        self._readable()  # what came with the channel's confirmation is already in libssh2's buffers
        return stream

    def _check_host_key(self, endpoint: Endpoint, known_hosts: str) -> None:
        key = self._host_key
        assert key is not None
        addr = self._sock.getpeername()[0]
        trusted, _ca, revoked, *_ = asyncssh.read_known_hosts(known_hosts).match(endpoint.host, addr, endpoint.port)
        data = key.public_data
        if any(k.public_data == data for k in revoked) or not any(k.public_data == data for k in trusted):
            raise asyncssh.HostKeyNotVerifiable("Host key is not trusted")
        weak = weak_key_reason(key)
        if weak:
            raise weak_host_key(endpoint, weak, known_hosts)

    def get_server_host_key(self) -> asyncssh.SSHKey | None:
        return self._host_key

    # ------------------------------------------------------------ reading and writing

    def _readable(self) -> None:
        chan, stream = self._chan, self._stream
        if chan is None or stream is None or self._closed:
            return
        try:
            while True:
                if stream.handler is None:
                    # Before the hello is taken: what the far end says on stderr (when it refuses, why). Read before
                    # stdout, as every read drains the socket: stdout's read below takes what this one took in.
                    err_size, err = chan.read_stderr(STDERR_SIZE)
                    if err_size > 0:
                        stream.data_received(err, _EXTENDED_STDERR)
                size, data = chan.read(READ_SIZE)
                if size > 0:
                    stream.data_received(data, None)
                    if self._closed:  # the handler closed the link
                        return
                    if chan.poll_channel_read(0) or (stream.handler is None and chan.poll_channel_read(1)):
                        continue
                    # Nothing more in libssh2's hands: its read above read the socket until it was dry, so another
                    # would be one more recv() that finds nothing. What comes next wakes the loop again. An end
                    # that came with the data is read below as the empty read would have said it; so is stderr
                    # queued behind it, which libssh2's eof() waits for (a traceback, then the exit).
                    size = 0 if chan.eof() or chan.poll_channel_read(1) else LIBSSH2_ERROR_EAGAIN
                while size == 0:  # its last words, with the channel's end (eof() waits until all are read)
                    err_size, err = chan.read_stderr(STDERR_SIZE)
                    if err_size <= 0:
                        break
                    stream.data_received(err, _EXTENDED_STDERR)
                if size == 0 and chan.eof():
                    self.close(None)
                    return
                if size < 0 and size != LIBSSH2_ERROR_EAGAIN:
                    self.close(ConnectionError(f"the link failed (libssh2 error {size})"))
                    return
                # A write reads the socket first (see _flush): what it took in is read before the loop sleeps.
                if not (self._out and self._flush()):
                    break
        except SSH2Error as exc:
            self.close(ConnectionError(f"the connection was lost ({_why(exc)})"))
            return
        self._watch_writable()

    def _reread_now(self) -> None:
        self._reread = False
        self._readable()

    def write(self, data: bytes) -> None:
        if self._closed or self._chan is None:
            raise ConnectionError("the stream is not open")
        self._out += data
        self._flush()
        # libssh2 reads what the socket holds before it writes (window adjusts), frames for us included: the socket
        # is then drained and will not wake the loop for them. They are read on the loop's next turn, not when the
        # node's next frame comes (seconds later, at a summary's cadence).
        if not self._reread:
            self._reread = True
            self._loop.call_soon(self._reread_now)

    def _on_writable(self) -> None:
        # Our bytes, or a packet libssh2 had to postpone inside a read (a window adjust, a keepalive's answer, a
        # rekey's): the read goes on where it stopped, and takes in what the write did.
        self._flush()
        self._readable()

    def _watch_writable(self) -> None:
        """Be woken when the socket takes more, while libssh2 waits to send (ours or its own)."""
        if self._closed:
            return
        want = bool(self._session.block_directions() & _ssh2_session.LIBSSH2_SESSION_BLOCK_OUTBOUND)
        if want and not self._writer_on:
            self._loop.add_writer(self._fd, self._on_writable)
            self._writer_on = True
        elif not want and self._writer_on:
            self._loop.remove_writer(self._fd)
            self._writer_on = False

    def _flush(self) -> int:
        """Write what is held, as far as the socket takes it now; the bytes written."""
        wrote = 0
        try:
            while self._out:
                rc, written = self._chan.write(bytes(self._out))
                if written > 0:
                    del self._out[:written]
                    wrote += written
                if rc == LIBSSH2_ERROR_EAGAIN or written <= 0:
                    break
        except SSH2Error as exc:
            self.close(ConnectionError(f"the connection was lost while writing ({_why(exc)})"))
            return 0
        self._watch_writable()
        return wrote

    # ------------------------------------------------------------ closing

    def close(self, exc: Exception | None = None) -> None:
        """Close the link; its stream's ``closed`` ends (with None, or ``exc``) if nothing else ended it first."""
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        if self._writer_on:
            self._loop.remove_writer(self._fd)
            self._writer_on = False
        try:
            if self._chan is not None:
                self._chan.close()  # closed now, while the socket is ours: freed later, it sends nothing
            self._session.disconnect()  # non-blocking: sent if the socket takes it now
        except SSH2Error:
            pass
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        # Shut, not closed: it closes when libssh2's last object that may use it is freed (_Descriptor).
        self._chan = self._session = self._held = None
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.connection_lost(exc)


def _why(exc: BaseException) -> str:
    text = " ".join(str(a) for a in exc.args if a) or type(exc).__name__
    return text


async def open_lean(endpoint: Endpoint, conns: dict[Endpoint, Any], *, username: str, key: asyncssh.SSHKey,
                    known_hosts: str, subsystem: str) -> tuple[LeanConnection, LineStream]:
    """A libssh2 link to ``endpoint``'s agent, kept in ``conns`` as soon as it exists (the caller closes it)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
    last: OSError | None = None
    for family, kind, proto, _name, addr in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
        except OSError as exc:
            sock.close()
            last = exc
            continue
        except BaseException:  # cancelled (the caller's timeout): the socket is ours to close
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = LeanConnection(sock)
        conns[endpoint] = conn
        stream = await conn.open(endpoint, username=username, key=key, known_hosts=known_hosts, subsystem=subsystem)
        return conn, stream
    raise last or OSError(f"no address for {endpoint.host}")
