"""asyncssh's per-packet path as gridwatch's links run it: AES-GCM seals and opens as asyncssh's own does, a
tampered packet is still refused, and the packet log still comes at asyncssh's debug level 3."""

from __future__ import annotations

from typing import Any

import asyncssh
import pytest
from asyncssh import encryption as ae
from asyncssh.logging import SSHLogger
from asyncssh.packet import SSHPacketLogger

from gridwatch.sshlink import fastpath
from gridwatch.sshlink.policy import client_options


def test_every_connection_option_set_installs_it_once() -> None:
    client_options()
    assert fastpath.install() is True
    assert ae.GCMCipher.__name__ == "KeptGCMCipher"


@pytest.mark.parametrize("cipher", ["aes128-gcm", "aes256-gcm"])
def test_the_kept_cipher_seals_opens_and_refuses_as_asyncssh_does(cipher: str) -> None:
    assert fastpath.install()
    theirs_class: Any = ae.GCMCipher.__mro__[1]  # asyncssh's own GCMCipher, under the kept one
    size = 16 if cipher == "aes128-gcm" else 32
    key, iv = bytes(range(size)), bytes(range(12))
    theirs, ours, opener = theirs_class(cipher, key, iv), ae.GCMCipher(cipher, key, iv), ae.GCMCipher(cipher, key, iv)
    for n in range(50):  # each packet its own nonce: the kept counter moves as asyncssh's does
        header, data = n.to_bytes(4, "big"), bytes([n % 256]) * (16 * (n % 7 + 1))
        sealed = ours.encrypt_and_sign(header, data)
        assert sealed == theirs.encrypt_and_sign(header, data)
        assert opener.verify_and_decrypt(header, sealed[0][4:], sealed[1]) == data
    header, data = b"\x00\x00\x00\x09", b"x" * 32
    body, mac = ours.encrypt_and_sign(header, data)
    tampered = bytes([body[4] ^ 1]) + body[5:]
    assert opener.verify_and_decrypt(header, tampered, mac) is None  # asyncssh raises MACError on None


def test_the_packet_log_is_formatted_only_at_asyncssh_debug_level_3(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fastpath.install()
    written: list[str] = []

    class Logged(SSHPacketLogger):
        @property
        def logger(self) -> Any:
            class Sink:
                def packet(self, pktid: Any, packet: bytes, msg: str, *args: Any) -> None:
                    written.append(msg % args)

            return Sink()

    handler = Logged()
    monkeypatch.setattr(SSHLogger, "_debug_level", 1)
    handler.log_received_packet(94, 7, b"\x00" * 20)
    assert written == []
    asyncssh.set_debug_level(3)
    handler.log_received_packet(94, 7, b"\x00" * 20)
    assert written == ["Received packet type 94, 20 bytes"]
