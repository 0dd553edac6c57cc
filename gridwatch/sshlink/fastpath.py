"""asyncssh's per-packet work that changes nothing for gridwatch, left out: a console or relay pays it per message.

A relay reads one small SSH packet per node every few seconds on each of hundreds of links, and a
console without a relay does the same on thousands; every packet runs through asyncssh's Python. Three
parts of that run do work whose result is thrown away or is the same every time:

- **AES-GCM made again per packet.** ``GCMCipher`` builds a new ``AESGCM`` from its key for each packet
  it seals or opens (a key check and an object each time); here each cipher keeps the one it built. A
  rekey makes a new ``GCMCipher``, so a kept ``AESGCM`` never outlives its key.
- **Packet logging formatted before it is dropped.** Every packet sent or received is named, its size
  spelled out in words and its payload gathered for a debug line that is written only at asyncssh's
  debug level 3; here nothing is done below that level (``asyncssh.set_debug_level(3)`` brings it back).
- **The GCM nonce's counter parsed from bytes per packet.** The next nonce is the same arithmetic,
  kept as an integer.

:func:`install` patches asyncssh's classes in place, once per process, and only after checking that
asyncssh's GCMCipher defines the methods it was written against and no other, and on a known key that
the patched cipher seals and opens exactly as asyncssh's own does; where an asyncssh version lays its
classes out otherwise, it leaves them as they are and says so at debug level.
"""

from __future__ import annotations

from typing import Any

from loguru import logger

_installed: bool | None = None


# What asyncssh 2.24's GCMCipher defines: a version that adds or renames one may keep state the kept cipher
# would not follow, so it is left as it is.
GCM_LAYOUT = frozenset({"__init__", "_update_iv", "encrypt_and_sign", "verify_and_decrypt"})


def install() -> bool:
    """Patch asyncssh's per-packet path (see the module's text); True when all of it is patched. Safe to call often.

    Each part is patched or left on its own; whatever goes wrong in a check leaves that part as asyncssh has it
    (said at debug level), never a connection that fails.
    """
    global _installed
    if _installed is None:
        _installed = True
        for part in (_patch_gcm, _patch_packet_log):
            try:
                part()
            except Exception as exc:  # noqa: BLE001 - any surprise in asyncssh's insides: leave that part alone
                logger.debug("asyncssh's {} left as it is: {}", part.__name__.removeprefix("_patch_"), exc)
                _installed = False
    return _installed


def gcm_layout_problem(cipher_class: type) -> str | None:
    """Why ``cipher_class`` is not the GCMCipher the kept one was written against; None when it is."""
    own = {name for name, value in vars(cipher_class).items()
           if callable(value) and (name == "__init__" or not name.startswith("__"))}
    if own != GCM_LAYOUT:
        return f"asyncssh's GCMCipher defines {sorted(own)}, not {sorted(GCM_LAYOUT)}"
    return None


def _patch_gcm() -> None:
    from asyncssh import encryption as ae
    from asyncssh.crypto import cipher as ac
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    original = ac.GCMCipher
    problem = gcm_layout_problem(original)
    if problem:
        raise TypeError(problem)
    mac_size: int = ac._GCM_MAC_SIZE  # noqa: SLF001 - asyncssh's own constant, checked by the round trip below

    class KeptGCMCipher(original):  # type: ignore[misc, valid-type]
        """asyncssh's GCM shim with its AESGCM and its nonce's counter kept between packets."""

        def __init__(self, cipher_name: str, key: bytes, iv: bytes) -> None:
            super().__init__(cipher_name, key, iv)
            self._aead = AESGCM(key)
            self._fixed = iv[:4]
            self._count = int.from_bytes(iv[4:], "big")

        def _update_iv(self) -> None:
            self._count = (self._count + 1) & 0xFFFFFFFFFFFFFFFF
            self._iv = self._fixed + self._count.to_bytes(8, "big")

        def encrypt_and_sign(self, header: bytes, data: bytes) -> tuple[bytes, bytes]:
            sealed = self._aead.encrypt(self._iv, data, header)
            self._update_iv()
            return header + sealed[:-mac_size], sealed[-mac_size:]

        def verify_and_decrypt(self, header: bytes, data: bytes, mac: bytes) -> bytes | None:
            try:
                opened: bytes | None = self._aead.decrypt(self._iv, data + mac, header)
            except InvalidTag:
                opened = None
            self._update_iv()
            return opened

    if not _same_seal(original, KeptGCMCipher):
        raise ValueError("the kept AES-GCM cipher does not match asyncssh's on a known key")
    if ae.GCMCipher is not original:
        raise AttributeError("asyncssh's GCM encryption does not build asyncssh's GCMCipher")
    # Module and class attributes replaced in place, on purpose (B010): the name GCMEncryption.new builds each
    # direction's cipher by, and asyncssh's own name for it.
    setattr(ae, "GCMCipher", KeptGCMCipher)  # noqa: B010
    setattr(ac, "GCMCipher", KeptGCMCipher)  # noqa: B010


def _same_seal(theirs: Any, ours: Any) -> bool:
    """Both ciphers seal three packets alike (the nonce wrapping over its counter's top), and ours opens theirs."""
    key, iv = bytes(range(16)), bytes(4) + b"\xff" * 8  # a counter about to wrap
    a, b, c = theirs("aes128-gcm", key, iv), ours("aes128-gcm", key, iv), ours("aes128-gcm", key, iv)
    for n in range(3):
        header, data = n.to_bytes(4, "big"), bytes([n]) * 48
        sealed = a.encrypt_and_sign(header, data)
        if b.encrypt_and_sign(header, data) != sealed:
            return False
        if c.verify_and_decrypt(header, sealed[0][len(header):], sealed[1]) != data:
            return False
    return True


def _patch_packet_log() -> None:
    from asyncssh.logging import SSHLogger
    from asyncssh.packet import SSHPacketLogger

    log_packet = SSHPacketLogger._log_packet  # noqa: SLF001 - the method the two below call

    def _log_packet(self: Any, msg: str, pkttype: int, pktid: int | None, packet: Any, note: str) -> None:
        # asyncssh writes a packet's line only at its debug level 3 (SSHLogger.packet); read it per call,
        # as set_debug_level may change it at any time.
        if SSHLogger._debug_level >= 3:  # noqa: SLF001
            log_packet(self, msg, pkttype, pktid, packet, note)

    if not isinstance(getattr(SSHLogger, "_debug_level", None), int):
        raise AttributeError("asyncssh's SSHLogger has no debug level")
    setattr(SSHPacketLogger, "_log_packet", _log_packet)  # noqa: B010 - the method both packet logs call
