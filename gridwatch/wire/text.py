"""Text a node supplies: cleaned of control characters and escape sequences, so none reaches a terminal as a command.

The :class:`Text` type marks every field (and dict key) a node fills; the hooks here clean it when a
frame is decoded and write it back as a plain string.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, TypeAlias

import msgspec

# Log lines are clipped on the node so that one 1 MB line cannot crowd out frames.
MAX_LINE_CHARS = 4096

# Also dropped: every Unicode format character (category Cf: bidi controls, zero-width
# space/joiners, LRM/RLM, word joiner, invisible operators, BOM, soft hyphen, tag
# characters) and the other invisible ones (combining grapheme joiner, Hangul fillers,
# variation selectors), so "node\u200b-1" or "node\U000e0041-1" cannot pose as "node-1".
_CONTROL = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u00ad\u034f\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2"
    "\u115f\u1160\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\u3164\ufe00-\ufe0f"
    "\ufeff\uffa0\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3"
    "\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f\U000e0100-\U000e01ef]"
)
_WHITESPACE_CONTROL = re.compile(r"[\t\n\r\u2028\u2029]")


if TYPE_CHECKING:
    # To the type checker Text is a plain str. The class exists so the decoder can find
    # every field (and dict key) a node fills and clean it; the strings our own code puts
    # into a frame are trusted, and a nominal subtype would reject every str literal used
    # as a dict key (dict keys are invariant) without checking anything about cleaning.
    Text: TypeAlias = str
else:

    class Text(str):
        """A string that came from a node: cleaned on decode, rendered as plain text."""

        __slots__ = ()


def clean_text(value: str, limit: int = MAX_LINE_CHARS) -> str:
    """Drop control characters (ESC, C1, bidi overrides, zero-width and other invisible ones) and clip to ``limit``.

    Removing ESC alone defuses every ANSI/OSC sequence: what remains (``[31m``)
    is harmless printable text, kept so an operator can see something was there.
    """
    if len(value) <= limit and value.isascii() and value.isprintable():
        return value  # printable ASCII holds no control character: nothing to drop
    if len(value) > limit:
        value = value[:limit] + "…"
    value = _WHITESPACE_CONTROL.sub(" ", value)
    return _CONTROL.sub("", value)


# Short node text repeats in every frame (node names, GPU states, job and phase names): each is
# cleaned once and the same Text returned after. Bounded, so unique strings cannot grow it.
_TEXT_SEEN: dict[str, Any] = {}
_TEXT_SEEN_CHARS = 64
_TEXT_SEEN_MAX = 16_384


def text_dec_hook(type_: type, obj: Any) -> Any:
    """msgspec ``dec_hook`` that cleans every :class:`Text` field; for any decoder of node text.

    Every dict a node fills is keyed by :class:`Text` too, so keys pass through here as well.
    """
    if type_ is Text:
        cached = _TEXT_SEEN.get(obj) if isinstance(obj, str) else None
        if cached is not None:
            return cached
        if not isinstance(obj, str):
            raise msgspec.ValidationError(f"expected a string, got {type(obj).__name__}")
        text = Text(clean_text(obj))
        if len(obj) <= _TEXT_SEEN_CHARS and len(_TEXT_SEEN) < _TEXT_SEEN_MAX:
            _TEXT_SEEN[obj] = text
        return text
    raise NotImplementedError(f"unsupported type {type_!r}")


def text_enc_hook(obj: Any) -> Any:
    """msgspec ``enc_hook`` that writes :class:`Text` as a plain string."""
    if isinstance(obj, str):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def as_builtins(obj: Any) -> Any:
    """Decoded frame data as plain builtins: frame text is a str subclass, which ``msgspec.convert`` refuses."""
    if isinstance(obj, dict):
        return {str(k): as_builtins(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [as_builtins(v) for v in obj]
    if isinstance(obj, str):
        return str(obj)
    return obj
