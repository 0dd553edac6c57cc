"""The SSH algorithms both ends accept: what current OpenSSH accepts, so no SHA-1 and no short RSA keys.

The agent's server and every console-side connection (the fleet, ``keys trust``,
``tail``, pre-flight) pass :func:`server_options` or :func:`client_options` to asyncssh, and check keys
with :func:`weak_key_reason`; one list, so the two ends cannot drift apart.
"""

from __future__ import annotations

import asyncssh
from asyncssh.constants import MSG_IGNORE
from asyncssh.encryption import get_encryption_algs
from asyncssh.kex import get_kex_algs
from asyncssh.mac import get_mac_algs
from asyncssh.public_key import get_public_key_algs

from gridwatch.sshlink import fastpath

# RSA keys shorter than this are refused, as OpenSSH 8.8+ refuses them
# (RequiredRSASize 1024 there; 2048 is what NIST and OpenSSH's ssh-keygen default to).
MIN_RSA_BITS = 2048

# In order of preference. SHA-1 kex (group1/group14-sha1, gex-sha1), SHA-1 MACs
# and the ssh-rsa (SHA-1) signature are left out, as in OpenSSH's defaults.
_KEX = (
    "mlkem768x25519-sha256",
    "curve25519-sha256",
    "curve25519-sha256@libssh.org",
    "ecdh-sha2-nistp256",
    "ecdh-sha2-nistp384",
    "ecdh-sha2-nistp521",
    "diffie-hellman-group-exchange-sha256",
    "diffie-hellman-group16-sha512",
    "diffie-hellman-group18-sha512",
    "diffie-hellman-group14-sha256",
)
# AEAD and counter-mode ciphers only (as asyncssh's and OpenSSH's defaults): no CBC. asyncssh puts an empty
# SSH_MSG_IGNORE before every packet it sends, the remedy RFC 4251 (9.3.1) gives for CBC's predictable IVs;
# with none of these it protects nothing, and it doubles what a console decrypts per message (quiet_ignores).
# AES-GCM first: it costs the console less CPU per frame than ChaCha20.
_CIPHERS = (
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "chacha20-poly1305@openssh.com",
    "aes128-ctr",
)
_MACS = (
    "umac-128-etm@openssh.com",
    "hmac-sha2-256-etm@openssh.com",
    "hmac-sha2-512-etm@openssh.com",
    "umac-128@openssh.com",
    "hmac-sha2-256",
    "hmac-sha2-512",
)
_SIGNATURES = (
    "ssh-ed25519",
    "sk-ssh-ed25519@openssh.com",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "sk-ecdsa-sha2-nistp256@openssh.com",
    "rsa-sha2-512",
    "rsa-sha2-256",
)


def _supported(wanted: tuple[str, ...], available: list[bytes]) -> list[str]:
    # Keep only what this asyncssh build offers (mlkem needs a recent one).
    have = {a.decode() for a in available}
    return [a for a in wanted if a in have]


KEX_ALGS = _supported(_KEX, get_kex_algs())
MAC_ALGS = _supported(_MACS, get_mac_algs())
ENCRYPTION_ALGS = _supported(_CIPHERS, get_encryption_algs())
SIGNATURE_ALGS = _supported(_SIGNATURES, get_public_key_algs())


def server_options() -> dict[str, list[str]]:
    """Keyword arguments for ``asyncssh.create_server`` (its host key algorithms follow from its keys)."""
    fastpath.install()  # every connection gridwatch makes or takes passes here (once a process)
    return {
        "kex_algs": list(KEX_ALGS),
        "encryption_algs": list(ENCRYPTION_ALGS),
        "mac_algs": list(MAC_ALGS),
        "signature_algs": list(SIGNATURE_ALGS),
    }


def client_options() -> dict[str, list[str]]:
    """Keyword arguments for ``asyncssh.connect`` and ``get_server_host_key``."""
    return {**server_options(), "server_host_key_algs": list(SIGNATURE_ALGS)}


def weak_key_reason(key: asyncssh.SSHKey) -> str | None:
    """Why a key is too weak to accept (an RSA key under MIN_RSA_BITS), or None."""
    if key.get_algorithm() == "ssh-rsa":
        bits = int(getattr(key.pyca_key, "key_size", 0))
        if bits < MIN_RSA_BITS:
            return f"a {bits}-bit RSA key (at least {MIN_RSA_BITS} bits are required)"
    elif key.get_algorithm() in ("ssh-dss",):
        return "a DSA key (DSA is no longer accepted)"
    return None


_EMPTY_STRING = b"\x00\x00\x00\x00"  # an SSH string of no bytes: what asyncssh's padding ignores carry


def quiet_ignores(conn: asyncssh.SSHClientConnection | asyncssh.SSHServerConnection) -> None:
    """Send no empty SSH_MSG_IGNORE before each packet on ``conn`` (see _CIPHERS: no cipher offered needs one).

    Measured on loopback, 500 links, a 760-byte message a second each: 61 µs of the receiver's CPU per
    message without them against 80 µs with (benchmarks/bench_ssh_message.py). An ignore a caller
    sends on purpose (with data) still goes.
    """
    send = conn.send_packet

    def send_packet(pkttype: int, *args: bytes, handler: object = None) -> None:
        if pkttype == MSG_IGNORE and args == (_EMPTY_STRING,):
            return
        send(pkttype, *args, handler=handler)  # type: ignore[arg-type]

    # asyncssh calls it through the instance, so the ignore it adds before each packet passes here.
    setattr(conn, "send_packet", send_packet)  # noqa: B010 - an instance attribute over the method, on purpose
