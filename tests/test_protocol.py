"""Frames on the wire: typed, versioned, and harmless whatever a node sends."""

from __future__ import annotations

import pytest

from gridwatch.agent.ringbuffer import FrameRing
from gridwatch.sshlink.hostlist import HostlistError, compress, expand, parse_endpoints
from gridwatch.wire import protocol as p
from gridwatch.wire.framing import LineBuffer


def test_every_frame_carries_version_type_seq_ts_node():
    line = p.encode(p.Event(kind=p.Text("xid"), code=79, seq=7, ts=1.5, node=p.Text("n1")))
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    for key in (b'"v":1', b'"type":"event"', b'"seq":7', b'"ts":1.5', b'"node":"n1"'):
        assert key in line


@pytest.mark.parametrize(
    "line,code",
    [
        (b'{"type":"event","kind":"xid"', "bad_frame"),  # truncated
        (b"\x00\xff\xfe garbage", "bad_frame"),
        (b"[1,2,3]", "bad_frame"),
        (b'{"type":"quantum_state","v":1}', "unknown_type"),
        (b'{"type":"event","v":1}', "bad_frame"),  # missing kind
        (b'{"type":"sample","gpus":"many"}', "bad_frame"),
        (b"{" + b" " * (p.MAX_FRAME_BYTES + 1) + b"}", "too_large"),
    ],
)
def test_bad_frames_get_a_one_line_reason(line, code):
    with pytest.raises(p.FrameError) as info:
        p.decode_agent_frame(line)
    assert info.value.code == code
    assert "\n" not in str(info.value)


def test_a_newer_protocol_version_is_read_as_far_as_understood():
    frame = p.decode_agent_frame(b'{"type":"sample","v":7,"seq":3,"node":"n","hologram":{"x":1},"gpus":[{"index":0,"util":50,"qubits":4}]}')
    assert isinstance(frame, p.Sample) and frame.v == 7 and frame.gpus[0].util == 50


def test_node_text_loses_escape_sequences_and_control_characters():
    hostile = '{"type":"event","kind":"xid","node":"n\\u001b]0;pwned\\u0007\\u001b[2J","message":"a\\u009b31mb\\r\\nc\\u202edcba"}'
    frame = p.decode_agent_frame(hostile)
    for text in (frame.node, frame.message):
        assert not any(ord(ch) < 32 or 0x7F <= ord(ch) <= 0x9F or ch == "\u202e" for ch in text)
    assert frame.node == "n]0;pwned[2J"
    result = p.decode_agent_frame('{"type":"action_result","id":"1","action":"x","ok":true,"data":{"k\\u001b":["\\u001b[5m"]}}')
    assert result.data == {"k": ["[5m"]}


@pytest.mark.parametrize("state", ["\u001b[31m", "ok;rm", "OK", "", "x" * 33])
def test_a_summary_whose_gpu_state_is_no_word_is_refused_and_says_why(state):
    line = p.encode(p.Summary(node=p.Text("n1"), seq=2, gpus=[p.GpuBrief(0, 50), p.GpuBrief(1, 60, state=state)]))
    with pytest.raises(p.FrameError) as info:
        p.decode_agent_frame(line)
    assert info.value.code == "bad_frame" and "\n" not in str(info.value) and "\x1b" not in str(info.value)
    assert "invalid summary frame" in str(info.value)


def test_a_gpu_state_word_no_console_knows_yet_still_decodes_every_time():
    for _ in range(2):  # the second time from the words already seen
        frame = p.decode_agent_frame(p.encode(p.Summary(node=p.Text("n1"), seq=2, gpus=[p.GpuBrief(0, 50, state="fell_off_bus")])))
        assert isinstance(frame, p.Summary) and frame.gpus[0].state == "fell_off_bus"


def test_long_text_is_clipped():
    frame = p.decode_agent_frame(p.encode(p.LogLine(source=p.Text("f"), line=p.Text("x" * 1_000_000))))
    assert len(frame.line) <= p.MAX_LINE_CHARS + 1


def test_line_buffer_splits_drops_oversized_and_keeps_a_partial_tail():
    buf = LineBuffer(limit=10)
    assert buf.feed(b"ab\ncd") == [b"ab"]
    assert buf.feed(b"e\n" + b"x" * 25) == [b"cde"]
    assert buf.feed(b"yyy\nok\n") == [b"ok"]
    assert buf.oversized == 1
    assert buf.feed(b"half a fra") == [] and buf.pending == 10  # an agent that died mid-frame


def test_ring_resumes_or_reports_the_gap():
    ring = FrameRing(3)
    for i in range(1, 6):
        ring.append(b"%d" % i)
    assert ring.first_seq == 3 and ring.last_seq == 5
    assert ring.since(3) == ([b"4", b"5"], None)
    assert ring.since(0) == ([b"3", b"4", b"5"], (1, 2))
    assert ring.since(5) == ([], None)


def test_hostlist_syntax():
    assert expand("node[001-003,010]") == ["node001", "node002", "node003", "node010"]
    assert expand("a[1-2]b[1-2]") == ["a1b1", "a1b2", "a2b1", "a2b2"]
    assert compress(expand("node[001-128],login1")) == "node[001-128],login1"
    eps = parse_endpoints("node[01-02]:9000,127.0.0.1:[8022-8023]")
    assert [str(e) for e in eps] == ["node01:9000", "node02:9000", "127.0.0.1:8022", "127.0.0.1:8023"]
    for bad in ("node[1-", "node[3-1]", "node[a-b]", "", "n[1-99999999]"):
        with pytest.raises(HostlistError):
            expand(bad)
    # Ranges under the cap each, past it together: in one bracket, or as many parts.
    for combined in ("n[" + ",".join(["0-90000"] * 100) + "]", ",".join(f"r{i}n[0-90000]" for i in range(100))):
        with pytest.raises(HostlistError, match="more than 100000 hosts"):
            expand(combined)


def test_why_an_action_failed_travels_as_a_code_and_a_phase_must_be_one_the_wire_names() -> None:
    result = p.ActionResult(id=p.Text("1"), action=p.Text("restart_from"), ok=False,
                            message=p.Text("any sentence at all"), code=p.Text(p.ResultCode.TRAINER_ABSENT))
    back = p.decode_agent_frame(p.encode(result))
    assert isinstance(back, p.ActionResult) and back.code == p.ResultCode.TRAINER_ABSENT
    sample = p.encode(p.Summary(node=p.Text("n1"), trainer=p.TrainerStatus(phase=p.TrainerPhase.REFORMING)))
    got = p.decode_agent_frame(sample)
    assert isinstance(got, p.Summary) and got.trainer is not None and got.trainer.phase is p.TrainerPhase.REFORMING
    with pytest.raises(p.FrameError, match="invalid summary frame"):
        p.decode_agent_frame(sample.replace(b"re-forming", b"sleeping!!"))


def test_an_endpoint_made_twice_is_the_same_key_and_name() -> None:
    from gridwatch.sshlink.hostlist import Endpoint

    a, b = Endpoint("node01", 8022), Endpoint("node01", 8022)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != Endpoint("node01", 8023) and str(a) == "node01:8022"
    assert repr(a) == "Endpoint(host='node01', port=8022)"


@pytest.mark.parametrize("endpoint", ["10.0.0.1:8022", 'we"ird\\:1', "n\u00fcde:2", "\x1b[31mred:3",
                                      '"frame":"\\u0000relayed frame\\u0000":4'])
def test_a_relayed_line_is_the_envelope_the_encoder_writes_and_gives_its_frame_back(endpoint: str) -> None:
    import msgspec

    line = p.encode(p.Summary(node=p.Text("node01"), seq=7, ts=1.0, gpus=[]))[:-1]
    wrapped = p.relayed_line(endpoint, line + b" ")
    assert wrapped == p.encode(p.Relayed(endpoint=p.Text(endpoint), frame=msgspec.Raw(line)))
    outer = p.decode_agent_frame(wrapped)
    assert isinstance(outer, p.Relayed) and bytes(outer.frame) == line
