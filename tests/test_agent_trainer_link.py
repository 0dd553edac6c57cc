"""The agent relays its local trainer: status in samples, events once, controls as actions."""

from __future__ import annotations

import os
import time

import pytest

from gridwatch.sshlink.client import Fleet, FleetOptions
from gridwatch.sshlink.hostlist import parse_endpoints
from gridwatch.trainer.control_server import ControlServer
from gridwatch.wire import protocol as p
from tests.conftest import start_agent, stop_agent, wait_until


async def test_status_events_and_isolation_reach_the_trainer(keys, tmp_path):
    sock = str(tmp_path / "trainer.sock")
    status = p.TrainerStatus(phase=p.Text("training"), step=41, loss=2.5, world_size=2, pid=None)
    status.events = [p.Event(kind=p.Text("nan_loss"), severity=p.Text("error"), message=p.Text("loss is nan at step 40"), seq=1)]
    server = ControlServer(sock, lambda: status, node="node-1")
    server.start()
    ra = await start_agent(keys)
    from gridwatch.agent.trainer_link import TrainerLink

    ra.agent.trainer = TrainerLink(sock, interval=0.05)
    ra.agent.trainer.start()
    frames: list[p.Frame] = []
    fleet = Fleet(parse_endpoints(ra.spec), FleetOptions(key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts)),
                  on_frame=lambda link, f: frames.append(f))
    await fleet.start()
    try:
        await wait_until(lambda: any(isinstance(f, p.Sample) and f.trainer and f.trainer.step == 41 for f in frames), what="trainer status")
        await wait_until(lambda: [f for f in frames if isinstance(f, p.Event) and f.kind == "nan_loss"], what="nan event")
        n_before = sum(1 for f in frames if isinstance(f, p.Event) and f.kind == "nan_loss")
        res = await fleet.action("node-1", "isolate", reason="test")
        assert res.ok and "trainer" in res.message
        await wait_until(lambda: any(r.cmd == "leave" for r in server.take()), what="leave control delivered")
        ck = await fleet.action("node-1", "checkpoint_now")
        assert ck.ok, ck.message
        # the same trainer event is relayed once, however many status polls see it
        assert sum(1 for f in frames if isinstance(f, p.Event) and f.kind == "nan_loss") == n_before == 1
    finally:
        await fleet.stop()
        await ra.agent.trainer.stop()
        await stop_agent(ra)
        server.stop()


async def test_no_trainer_is_a_clear_answer(agent, keys):
    fleet = Fleet(parse_endpoints(agent.spec), FleetOptions(key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts)))
    await fleet.start()
    try:
        await wait_until(lambda: fleet.connected, what="connection")
        res = await fleet.action("node-1", "pause")
        assert not res.ok and "no trainer is attached" in res.message
        crash = await fleet.action("node-1", "inject_fault", {"kind": "trainer-crash"})
        assert not crash.ok and "no local trainer" in crash.message
    finally:
        await fleet.stop()


def test_a_trainer_is_reported_gone_only_after_the_grace():
    from gridwatch.agent.trainer_link import TrainerLink

    t = [0.0]
    link = TrainerLink("/nonexistent.sock", grace=15.0, clock=lambda: t[0])
    link.answered(p.TrainerStatus(phase=p.Text("training"), step=5))
    for t[0] in (1.0, 5.0, 10.0):  # workers restarting after a planned re-formation
        link.unanswered("no trainer is listening")
    assert link.take_events() == [] and link.attached
    link.answered(p.TrainerStatus(phase=p.Text("training"), step=9))
    for t[0] in (20.0, 30.0, 36.0):  # gone for good
        link.unanswered("no trainer is listening")
    events = link.take_events()
    assert [e.kind for e in events] == ["trainer_exit"] and "16 s" in events[0].message
    assert link.status.phase == "gone"
    link.unanswered("still nothing")
    assert link.take_events() == []  # said once


def test_a_trainer_that_left_on_request_is_not_a_fault():
    from gridwatch.agent.trainer_link import TrainerLink

    t = [0.0]
    link = TrainerLink("/nonexistent.sock", grace=15.0, clock=lambda: t[0])
    link.answered(p.TrainerStatus(phase=p.Text("training"), step=5))
    link.leaving = True  # what a successful "leave" control sets (the node was isolated)
    t[0] = 1.0
    link.unanswered("no trainer is listening")
    events = link.take_events()
    assert [(e.kind, e.severity) for e in events] == [("trainer_left", "info")]
    for t[0] in (20.0, 40.0):
        link.unanswered("no trainer is listening")
    assert link.take_events() == [], "no trainer_exit page for a node taken out on purpose"
    link.answered(p.TrainerStatus(phase=p.Text("training"), step=50))  # repaired: it rejoined
    assert not link.leaving
    for t[0] in (60.0, 80.0):
        link.unanswered("no trainer is listening")
    assert [e.kind for e in link.take_events()] == ["trainer_exit"]



def test_a_leaving_trainer_that_answers_late_is_still_leaving_not_left_and_its_exit_is_no_fault():
    """A trainer told to leave may be busy on its way out (saving, tearing its group down) and miss a poll: it
    is not yet left, so its next answer keeps it leaving, and when it goes, that is the leave, not a fault."""
    from gridwatch.agent.trainer_link import TrainerLink

    t = [0.0]
    link = TrainerLink("/nonexistent.sock", grace=15.0, clock=lambda: t[0])
    link.answered(p.TrainerStatus(phase=p.Text("training"), step=5, pid=os.getpid()))  # a process that lives
    link.leaving = True  # what a successful "leave" control sets (the node was isolated)
    t[0] = 1.0
    link.unanswered("trainer at x did not answer within 2 s", late=True)
    assert link.take_events() == [] and link.attached, "not left while its process is there and busy"
    link.answered(p.TrainerStatus(phase=p.Text("training"), step=6, pid=os.getpid()))
    assert link.leaving
    t[0] = 3.0
    link.unanswered("no trainer is listening")  # it went
    assert [e.kind for e in link.take_events()] == ["trainer_left"]
    for t[0] in (20.0, 40.0):
        link.unanswered("no trainer is listening")
    assert link.take_events() == [], "no trainer_exit page for a node taken out on purpose"
    # One that stays busy past the grace is left all the same: the node is out either way.
    link = TrainerLink("/nonexistent.sock", grace=15.0, clock=lambda: t[0])
    t[0] = 50.0
    link.answered(p.TrainerStatus(phase=p.Text("training"), step=5, pid=os.getpid()))
    link.leaving = True
    for t[0] in (51.0, 60.0, 66.0):
        link.unanswered("did not answer", late=True)
    assert [e.kind for e in link.take_events()] == ["trainer_left"]


def test_a_new_life_after_a_leave_is_a_member_again_until_told():
    """The leave was its previous life's: a process started again on the node (torchrun) is in the job, so its
    silence is a fault again and the keep-out may tell it to leave."""
    from gridwatch.agent.trainer_link import TrainerLink

    link = TrainerLink("/nonexistent.sock", grace=15.0)
    link.answered(p.TrainerStatus(phase=p.Text("training"), step=5, pid=1001))
    link.leaving = True
    link.answered(p.TrainerStatus(phase=p.Text("joining"), step=5, pid=1002))
    assert not link.leaving


async def test_the_keep_out_waits_after_a_leave_that_got_no_answer(agent):
    """A leave that timed out may still be acted on (the trainer queues controls): the keep-out does not send
    another at once, which would make the job re-form twice; it does once the wait is over."""
    from gridwatch.agent.trainer_link import TrainerLink

    link = TrainerLink("/nonexistent.sock")
    agent.agent.trainer = link
    training = p.TrainerStatus(phase=p.Text("training"), step=5)
    link.leave_ended_at = link.clock()  # the isolation's leave just gave up
    agent.agent._keep_out(training)  # noqa: SLF001 - the rule itself, on its own
    lines, _ = agent.agent.ring.since(0)
    assert not any(b'"trainer_kept_out"' in line for line in lines)
    link.leave_ended_at = link.clock() - 60.0
    agent.agent._keep_out(training)  # noqa: SLF001
    lines, _ = agent.agent.ring.since(0)
    assert any(b'"trainer_kept_out"' in line for line in lines)
    await wait_until(lambda: not link.leave_sent, what="the leave sent (to no trainer) ended")

def test_a_silent_trainer_says_whether_its_process_is_still_there():
    """Frozen (the process is there) is evidence about the node; exited or killed (gone) is a software fault."""
    import subprocess
    import sys

    from gridwatch.agent.trainer_link import TrainerLink

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid, process in ((os.getpid(), "alive"), (dead.pid, "gone"), (None, "unknown")):
        t = [0.0]
        link = TrainerLink("/nonexistent.sock", grace=5.0, clock=lambda: t[0])
        link.answered(p.TrainerStatus(phase=p.Text("training"), step=5, pid=pid))
        for t[0] in (1.0, 7.0):
            link.unanswered("no trainer is listening")
        (event,) = link.take_events()
        assert event.kind == "trainer_exit" and event.details["process"] == process, (pid, event)
        # Told after the 5 s grace, at 7 s; the fault began at the first silent poll, 6 s before that.
        event.ts = time.time()
        assert abs((event.ts - p.fault_time(event)) - 6.0) < 1.0


async def test_an_isolated_nodes_trainer_back_in_the_job_is_told_to_leave_again(keys, tmp_path):
    """Isolation holds: a worker that (re)starts on an isolated node (torchrun restarted it, or it was not
    listening when the node was isolated) is told to leave the job again by the agent."""
    from tests.support_loop import FakeJob, agents_beside

    job = FakeJob(tmp_path, ["node-1"])
    (ra,) = await agents_beside(keys, job)
    try:
        ra.agent.set_isolated(True)  # isolated while its trainer was away: no leave was heard
        job.down("node-1")
        job.up("node-1")  # the worker comes back, training
        await wait_until(lambda: job.left.is_set(), 10, "the restarted trainer told to leave")
        lines, _ = ra.agent.ring.since(0)
        assert any(b'"trainer_kept_out"' in line for line in lines)
    finally:
        await ra.agent.trainer.stop()
        await stop_agent(ra)
        for server in list(job.servers.values()):
            server.stop()



async def test_an_isolation_whose_leave_is_slow_to_answer_tells_the_trainer_to_leave_once(keys, tmp_path):
    """The node is isolated before its trainer has answered the leave: the agent's own keep-out must not send a
    second leave meanwhile (in a real job each leave of a member makes the job re-form)."""
    import threading

    from gridwatch.agent.trainer_link import TrainerLink

    answered = threading.Event()
    leaves: list[float] = []

    class SlowToLeave(ControlServer):
        def answer(self, line: bytes):  # noqa: ANN201 - a ControlReply
            if b'"leave"' in line:
                leaves.append(time.monotonic())
                answered.wait(1.0)  # the trainer takes its time to answer: the agent keeps ticking meanwhile
            return super().answer(line)

    sock = str(tmp_path / "trainer.sock")
    server = SlowToLeave(sock, lambda: p.TrainerStatus(phase=p.Text("training"), step=7, pid=os.getpid()), node="node-1")
    server.start()
    ra = await start_agent(keys, interval=0.05)
    ra.agent.trainer = TrainerLink(sock, interval=0.05)
    ra.agent.trainer.start()
    fleet = Fleet(parse_endpoints(ra.spec), FleetOptions(key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts)))
    await fleet.start()
    try:
        await wait_until(lambda: ra.agent.trainer.attached, what="the trainer attached")
        await wait_until(lambda: fleet.find("node-1") is not None and fleet.connected, what="the node's link up")
        res = await fleet.action("node-1", "isolate", reason="xid 79")
        assert res.ok and "leave accepted" in res.message, res.message
        answered.set()
        assert len(leaves) == 1
        lines, _ = ra.agent.ring.since(0)
        assert not any(b'"trainer_kept_out"' in line for line in lines)
    finally:
        answered.set()
        await fleet.stop()
        await ra.agent.trainer.stop()
        await stop_agent(ra)
        server.stop()


def test_a_restarted_trainer_dates_its_crash_at_its_previous_lifes_last_answer():
    """torchrun's restart is told seconds after the crash (the new process must start first): the fault time is
    when the dead process last answered, not when its successor spoke."""
    from gridwatch.agent.trainer_link import TrainerLink

    link = TrainerLink("/nonexistent.sock", grace=15.0)
    link.answered(p.TrainerStatus(phase=p.Text("training"), step=5, pid=1001))
    last_heard = link.last_ok
    link.unanswered("no trainer is listening")  # it died
    told = time.time() + 6.0
    restart = p.Event(kind=p.Text("trainer_restarted"), severity=p.Text("error"), source=p.Text("trainer"),
                      seq=1, ts=told, message=p.Text("the trainer was restarted by torchrun (restart 1)"))
    link.answered(p.TrainerStatus(phase=p.Text("joining"), step=5, pid=1002, events=[restart]))
    (event,) = link.take_events()
    assert last_heard is not None and abs(p.fault_time(event) - last_heard) < 1e-3
    # The same process answering again after a pause dates nothing.
    again = p.Event(kind=p.Text("trainer_restarted"), severity=p.Text("error"), source=p.Text("trainer"), seq=2, ts=told)
    link.answered(p.TrainerStatus(phase=p.Text("training"), step=6, pid=1002, events=[again]))
    (event,) = link.take_events()
    assert p.fault_time(event) == told


async def test_a_killed_workers_crash_is_dated_at_its_death_not_at_its_last_answer():
    """A worker answers the link once a second; killed between two polls, its crash is dated when the
    kernel says its process ended (a pidfd), after its last answer, not up to a poll before the kill."""
    import signal
    import subprocess
    import sys

    from gridwatch.agent.trainer_link import TrainerLink

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        link = TrainerLink("/nonexistent.sock", grace=15.0)
        link.answered(p.TrainerStatus(phase=p.Text("training"), step=5, pid=worker.pid))
        if link.exits.unavailable:
            pytest.skip(f"this kernel gives no pidfds: {link.exits.unavailable}")
        last_heard = link.last_ok
        assert last_heard is not None
        # The kill comes between two polls, a while after the last answer (as a crash does).
        await wait_until(lambda: time.time() >= last_heard + 0.2, 5, "a moment past the last answer")
        killed = time.time()
        worker.send_signal(signal.SIGKILL)
        await wait_until(lambda: link.exits.exited_at(worker.pid) is not None, 10, "the worker's exit read")
        link.unanswered("no trainer is listening")
        restart = p.Event(kind=p.Text("trainer_restarted"), severity=p.Text("error"), source=p.Text("trainer"),
                          seq=1, ts=time.time() + 6.0, message=p.Text("restarted by torchrun (restart 1)"))
        link.answered(p.TrainerStatus(phase=p.Text("joining"), step=5, pid=os.getpid(), events=[restart]))
        (event,) = link.take_events()
        # Dated at the death (the detail is kept to the millisecond), not at the last answer 0.2 s before.
        assert p.fault_time(event) >= killed - 0.001 and p.fault_time(event) > last_heard + 0.1, (event, killed)
    finally:
        worker.kill()
        worker.wait()
        await link.stop()


def test_a_trainer_that_had_left_the_job_and_starts_again_is_a_return_not_a_crash():
    """The node was out, its worker had left the job; started again when the node is returned, torchrun's
    restart count says "restarted", but nothing crashed: no playbook must take it for a fault."""
    from gridwatch.agent.trainer_link import TrainerLink

    link = TrainerLink("/nonexistent.sock", grace=15.0)
    link.answered(p.TrainerStatus(phase=p.Text("left"), step=50, pid=1001))
    restart = p.Event(kind=p.Text("trainer_restarted"), severity=p.Text("error"), source=p.Text("trainer"),
                      seq=1, ts=time.time(), message=p.Text("the trainer was restarted by torchrun (restart 2)"))
    link.answered(p.TrainerStatus(phase=p.Text("joining"), step=50, pid=1002, events=[restart]))
    (event,) = link.take_events()
    assert event.kind == "trainer_rejoined" and event.severity == "info"
    assert "not a crash" in event.message


def test_a_worker_kept_out_on_an_isolated_node_that_dies_is_no_crash_but_one_that_was_joining_elsewhere_is():
    """While its node is out the coordinator takes no worker from it: one that gives up waiting and is started
    again cost the job nothing. On a node in service, a worker that dies while joining is a crash."""
    from gridwatch.agent.trainer_link import TrainerLink

    def restart_after(phase: str, node_out: bool) -> p.Event:
        link = TrainerLink("/nonexistent.sock", grace=15.0)
        link.node_out = node_out
        link.answered(p.TrainerStatus(phase=p.Text(phase), step=50, pid=1001))
        restart = p.Event(kind=p.Text("trainer_restarted"), severity=p.Text("error"), source=p.Text("trainer"),
                          seq=1, ts=time.time(), message=p.Text("restarted by torchrun (restart 2)"))
        link.answered(p.TrainerStatus(phase=p.Text("joining"), step=50, pid=1002, events=[restart]))
        (event,) = link.take_events()
        return event

    assert restart_after("joining", node_out=True).kind == "trainer_rejoined"
    assert restart_after("joining", node_out=False).kind == "trainer_restarted"
    assert restart_after("training", node_out=True).kind == "trainer_restarted"  # it was in the job when it died


def test_a_worker_kept_out_that_dies_just_as_its_node_is_returned_is_no_crash_either():
    """A repair clears the fault and returns the node while torchrun starts a worker that was kept out: the
    next life answers with the node back in service, but the life that died was still out."""
    from gridwatch.agent.trainer_link import TrainerLink

    link = TrainerLink("/nonexistent.sock", grace=15.0)
    link.node_out = True
    link.answered(p.TrainerStatus(phase=p.Text("starting"), step=50, pid=1001))
    link.node_out = False  # returned before the next life's first answer
    restart = p.Event(kind=p.Text("trainer_restarted"), severity=p.Text("error"), source=p.Text("trainer"),
                      seq=1, ts=time.time(), message=p.Text("restarted by torchrun (restart 3)"))
    link.answered(p.TrainerStatus(phase=p.Text("joining"), step=50, pid=1002, events=[restart]))
    (event,) = link.take_events()
    assert event.kind == "trainer_rejoined"
    # That life answered in service: its own death, had it one, would be a crash.
    restart = p.Event(kind=p.Text("trainer_restarted"), severity=p.Text("error"), source=p.Text("trainer"),
                      seq=2, ts=time.time(), message=p.Text("restarted by torchrun (restart 4)"))
    link.answered(p.TrainerStatus(phase=p.Text("joining"), step=50, pid=1003, events=[restart]))
    (event,) = link.take_events()
    assert event.kind == "trainer_restarted"


def test_a_kept_out_life_s_restart_told_in_a_later_answer_after_the_node_is_returned_is_no_crash():
    """Under load the new worker answers first and says it was restarted only later (once torch is up or it
    joins), by when a repair may have returned the node: its report still follows the life that had left."""
    from gridwatch.agent.trainer_link import TrainerLink

    link = TrainerLink("/nonexistent.sock", grace=15.0)
    link.node_out = True
    link.answered(p.TrainerStatus(phase=p.Text("left"), step=50, pid=1001))
    link.answered(p.TrainerStatus(phase=p.Text("starting"), step=50, pid=1002))  # no report of its restart yet
    link.node_out = False  # the repair returns the node
    restart = p.Event(kind=p.Text("trainer_restarted"), severity=p.Text("error"), source=p.Text("trainer"),
                      seq=1, ts=time.time(), message=p.Text("restarted by torchrun (restart 1)"))
    link.answered(p.TrainerStatus(phase=p.Text("joining"), step=50, pid=1002, events=[restart]))
    (event,) = link.take_events()
    assert event.kind == "trainer_rejoined"
    # A crash's report told late is dated at the dead life's last answer all the same.
    link = TrainerLink("/nonexistent.sock", grace=15.0)
    link.answered(p.TrainerStatus(phase=p.Text("training"), step=5, pid=1001))
    last_heard = link.last_ok
    link.answered(p.TrainerStatus(phase=p.Text("starting"), step=5, pid=1002))
    restart = p.Event(kind=p.Text("trainer_restarted"), severity=p.Text("error"), source=p.Text("trainer"),
                      seq=1, ts=time.time() + 6.0, message=p.Text("restarted by torchrun (restart 1)"))
    link.answered(p.TrainerStatus(phase=p.Text("joining"), step=5, pid=1002, events=[restart]))
    (event,) = link.take_events()
    assert event.kind == "trainer_restarted" and last_heard is not None
    assert abs(p.fault_time(event) - last_heard) < 1e-3
