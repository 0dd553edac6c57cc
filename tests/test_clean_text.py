"""Node text cleaning: nothing invisible or able to steer a terminal survives, printable text does."""

from __future__ import annotations

import sys
import unicodedata

from gridwatch.wire.protocol import clean_text


def test_every_unicode_format_character_is_dropped() -> None:
    # Category Cf is where the invisible look-alike tricks live (zero-width, bidi, tags).
    kept = [hex(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf" and clean_text(chr(c))]
    assert kept == []


def test_invisible_look_alikes_cannot_pose_as_a_node_name() -> None:
    for trick in ("\u200b", "\U000e0041", "\u034f", "\u3164", "\ufe0f", "\u2066", "\u00ad"):
        assert clean_text(f"node{trick}-1") == "node-1", repr(trick)


def test_ordinary_text_is_kept() -> None:
    line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus. é 日本 ✓"
    assert clean_text(line) == line
