"""Frames to and from lines of JSON: the encoder, and the decoders that refuse a line that is no frame, in one word why."""

from __future__ import annotations

import functools
from typing import Any, get_args

import msgspec

from gridwatch.wire.envelopes import (
    Passing,
    PassingEvent,
    PassingLog,
    PassingSample,
    PassingSummary,
    Relayed,
    RelayLink,
    RelaySubscribe,
)
from gridwatch.wire.frames import (
    PROTOCOL_VERSION,
    ActionResult,
    Error,
    Event,
    Frame,
    Gap,
    Hello,
    LogLine,
    Sample,
    SearchResult,
    Summary,
    state_word_refused,
)
from gridwatch.wire.requests import Action, Search, Subscribe
from gridwatch.wire.text import Text, clean_text, text_dec_hook, text_enc_hook

# A frame longer than this is refused whole rather than buffered: it is either
# a bug or hostile, and one node must not make the console hold megabytes.
MAX_FRAME_BYTES = 1 << 20
# Deeper than any frame we send; a deeper one is refused before anything recurses on it.
MAX_NESTING = 32


class FrameError(ValueError):
    """A line that is not a frame we can use; ``code`` says why in one word."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# What each end decodes: an agent's (or a relay's) frames, a console's, and either (recorded traces).
AgentFrame = Hello | Sample | Summary | Event | LogLine | ActionResult | SearchResult | Gap | Error | Relayed | RelayLink
ClientFrame = Subscribe | Action | Search | RelaySubscribe | Relayed
AnyFrame = AgentFrame | ClientFrame

FRAME_TYPES: frozenset[str] = frozenset(
    t.__struct_config__.tag for t in get_args(AnyFrame)
)


class _Envelope(msgspec.Struct):
    type: str = ""
    v: int = PROTOCOL_VERSION


_encoder = msgspec.json.Encoder(enc_hook=text_enc_hook)
_envelope = msgspec.json.Decoder(_Envelope)
_agent_decoder = msgspec.json.Decoder(AgentFrame, dec_hook=text_dec_hook)
_client_decoder = msgspec.json.Decoder(ClientFrame, dec_hook=text_dec_hook)
_any_decoder = msgspec.json.Decoder(AnyFrame, dec_hook=text_dec_hook)
_passing_decoder = msgspec.json.Decoder(PassingSummary | PassingSample | PassingEvent | PassingLog)


def encode(frame: Frame) -> bytes:
    """One frame as one line of JSON, newline included."""
    return _encoder.encode(frame) + b"\n"


def relayed(endpoint: str, frame: Frame) -> Relayed:
    """``frame`` of (or for) the node at ``endpoint``, wrapped to pass through a relay as it was written."""
    return Relayed(endpoint=Text(endpoint), frame=msgspec.Raw(encode(frame)[:-1]))


def relayed_line(endpoint: str, line: bytes) -> bytes:
    """:func:`relayed` for a frame still as the line it came in (no newline), encoded: the frame is not encoded again."""
    head, tail = _relayed_around(endpoint)
    return head + line.strip() + tail


@functools.lru_cache(maxsize=1 << 16)
def _relayed_around(endpoint: str) -> tuple[bytes, bytes]:
    """What a relayed frame of ``endpoint`` says before and after the frame: the same for each of its frames.

    A relay wraps every frame of its nodes; encoding the envelope anew each time cost it about as much as
    reading the frame's order and owner. Cut from the envelope around a stand-in frame, so the bytes are
    the encoder's own whatever the envelope's fields.
    """
    whole = encode(Relayed(endpoint=Text(endpoint), frame=msgspec.Raw(_STAND_IN)))
    at = whole.index(b'"frame":' + _STAND_IN) + len(b'"frame":')
    return whole[:at], whole[at + len(_STAND_IN):]


_STAND_IN = rb'"\u0000relayed frame\u0000"'  # a JSON string no endpoint's encoding contains


def decode_passing(line: bytes) -> Passing | None:
    """What a relay needs of a summary, sample, event or log line it passes on; None for any other line (or
    one that is no such frame), to be decoded whole. No text is built or cleaned: the console does that."""
    if len(line) > MAX_FRAME_BYTES:
        return None
    try:
        head: Passing = _passing_decoder.decode(line)
    except (msgspec.DecodeError, RecursionError):
        return None
    return head


def _decode(line: bytes | str, decoder: msgspec.json.Decoder) -> Frame:
    if isinstance(line, str):
        line = line.encode("utf-8", "replace")
    if len(line) > MAX_FRAME_BYTES:
        raise FrameError("too_large", f"frame of {len(line)} bytes exceeds {MAX_FRAME_BYTES}")
    line = line.strip()
    if not line:
        raise FrameError("bad_frame", "empty line")
    try:
        return _decode_checked(line, decoder)
    except RecursionError:
        # JSON nested hundreds deep: refused like any bad frame, never a crash of the reader.
        raise FrameError("bad_frame", "a frame nested too deep") from None


def _decode_checked(line: bytes, decoder: msgspec.json.Decoder) -> Frame:
    try:
        frame: Frame = decoder.decode(line)
        if isinstance(frame, Summary):  # the common frame: asked first
            refused = state_word_refused(frame.gpus)
            if refused is not None:
                raise FrameError("bad_frame", f"invalid summary frame: GPU state {clean_text(refused, 40)!r} "
                                              "is not a word of a-z and _")
        # Free-form payloads are not typed field by field, so they are cleaned here.
        elif isinstance(frame, ActionResult):
            frame.data = clean_any(frame.data)
        elif isinstance(frame, Action):
            frame.args = clean_any(frame.args)
    except msgspec.ValidationError as exc:
        try:
            env = _envelope.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise FrameError("bad_frame", f"not a frame: {clean_text(str(exc), 200)}") from None
        if env.type not in FRAME_TYPES:
            raise FrameError("unknown_type", f"unknown frame type {clean_text(env.type, 40)!r}") from None
        raise FrameError("bad_frame", f"invalid {clean_text(env.type, 40)} frame: {clean_text(str(exc), 200)}") from None
    except msgspec.DecodeError as exc:
        raise FrameError("bad_frame", f"malformed JSON: {clean_text(str(exc), 200)}") from None
    return frame


def clean_any(value: Any, depth: int = 0) -> Any:
    """Clean every string (keys included) inside a decoded JSON value.

    Raises :class:`FrameError` (``bad_frame``) past :data:`MAX_NESTING` levels.
    """
    if isinstance(value, str):
        return Text(clean_text(value))
    if isinstance(value, (dict, list)) and depth >= MAX_NESTING:
        raise FrameError("bad_frame", f"a frame nested deeper than {MAX_NESTING} levels")
    if isinstance(value, dict):
        return {Text(clean_text(str(k), 200)): clean_any(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_any(v, depth + 1) for v in value]
    return value


def decode_agent_frame(line: bytes | str) -> Frame:
    """Decode a line an agent sent. Raises :class:`FrameError` with a one-line reason.

    A frame from a newer protocol version is decoded as far as we understand it
    (unknown fields are ignored); the caller may note the version once.
    """
    return _decode(line, _agent_decoder)


def decode_client_frame(line: bytes | str) -> Frame:
    """Decode a line a console sent to an agent."""
    return _decode(line, _client_decoder)


def decode_any_frame(line: bytes | str) -> Frame:
    """Decode any frame (used when replaying recorded traces)."""
    return _decode(line, _any_decoder)
