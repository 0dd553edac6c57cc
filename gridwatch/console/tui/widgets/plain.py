"""The last line before the terminal: what a widget draws carries no control character.

Node text is cleaned where frames are decoded (:func:`gridwatch.wire.protocol.clean_text`);
widgets clean again, with the same function, so a string that reached them another
way (a peer's error, a key that slipped past) still cannot be an escape sequence.
Newlines are kept: they lay out multi-line panels. Markup is never parsed.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static

from gridwatch.wire.protocol import clean_text


def plain(value: str) -> str:
    """``value`` without control, bidi or invisible characters; line breaks kept."""
    if value.isprintable():
        return value  # the common case, one C-speed pass
    return "\n".join(clean_text(line, len(line)) for line in value.split("\n"))


def plain_text(text: Text) -> Text:
    """A rich Text with every control character dropped, styles kept on what remains."""
    source = text.plain
    if plain(source) == source:
        return text
    # Rare (something unclean got this far): rebuild one character at a time so spans stay aligned.
    out = Text(style=text.style, justify=text.justify, overflow=text.overflow, no_wrap=text.no_wrap, end=text.end)
    for piece in text.divide(range(1, len(source))):
        piece.plain = plain(piece.plain)
        out.append_text(piece)
    return out


class PlainStatic(Static):
    """A Static whose content is plain text: a str is never markup, and no control character is drawn.

    Content equal to what it shows is not set again: a view sets its lines at every tick, and each new
    content is laid out and painted again however alike (a fleet view's legend, title and status line).
    """

    def __init__(self, content: Any = "", **kwargs: Any) -> None:
        content = _plain_content(content)
        self._shown: tuple | None = _same_as(content)
        super().__init__(content, **kwargs)

    def update(self, content: Any = "", *, layout: bool = True) -> None:
        content = _plain_content(content)
        key = _same_as(content)
        if key is not None and key == self._shown:
            return
        self._shown = key
        super().update(content, layout=layout)


def _same_as(content: Any) -> tuple | None:
    """What makes two contents draw alike (text, styles, layout); None for a renderable that cannot be compared."""
    if isinstance(content, Text):
        return (content.plain, tuple(content.spans), str(content.style), content.justify, content.overflow,
                content.no_wrap, content.end)
    return None


def _plain_content(content: Any) -> Any:
    if isinstance(content, Text):
        return plain_text(content)
    if isinstance(content, str):
        return Text(plain(content))
    return content  # tables and other renderables are built from cleaned cells
