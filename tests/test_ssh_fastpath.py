"""asyncssh's per-packet path as gridwatch's links run it: AES-GCM seals and opens as asyncssh's own does, a
tampered packet is still refused, and the packet log still comes at asyncssh's debug level 3."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import asyncssh
import pytest
from asyncssh import encryption as ae
from asyncssh.logging import SSHLogger
from asyncssh.packet import SSHPacketLogger

from gridwatch.sshlink import fastpath


def test_a_process_that_makes_a_connection_s_options_runs_the_kept_path() -> None:
    # A fresh interpreter: nothing installed it before the options were asked for.
    probe = ("import asyncssh.encryption as ae; before = ae.GCMCipher.__name__; "
             "from gridwatch.sshlink.policy import client_options; client_options(); print(before, ae.GCMCipher.__name__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["GCMCipher", "KeptGCMCipher"]
    assert fastpath.install() is True and fastpath.install() is True  # once; asking again changes nothing


def test_a_gcm_cipher_laid_out_otherwise_is_left_as_asyncssh_has_it() -> None:
    assert fastpath.install()
    theirs: Any = ae.GCMCipher.__mro__[1]
    assert fastpath.gcm_layout_problem(theirs) is None

    class Later(theirs):  # a later asyncssh that keeps more state per packet than the kept cipher follows
        def __init__(self, cipher_name: str, key: bytes, iv: bytes) -> None:
            super().__init__(cipher_name, key, iv)

        def _update_iv(self) -> None: ...

        def encrypt_and_sign(self, header: bytes, data: bytes) -> Any: ...

        def verify_and_decrypt(self, header: bytes, data: bytes, mac: bytes) -> Any: ...

        def rekey(self) -> None: ...

    assert fastpath.gcm_layout_problem(Later) == (
        "asyncssh's GCMCipher defines ['__init__', '_update_iv', 'encrypt_and_sign', 'rekey', 'verify_and_decrypt'], "
        "not ['__init__', '_update_iv', 'encrypt_and_sign', 'verify_and_decrypt']")


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
