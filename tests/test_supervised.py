"""A training loop of the user's own under the console: status out; pause, checkpoint-now, restart-from and leave in,
through the same control socket and agent link as the reference trainer, with the user's save and load."""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from pathlib import Path

import pytest
import torch

from gridwatch.trainer import Next, Supervised
from gridwatch.wire.protocol import TrainerPhase
from tests.support_supervised import Agent


class Loop:
    """A user's loop: a tiny model, their own checkpoint files, ``Supervised`` called once a step."""

    def __init__(self, tmp: Path) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.dir = tmp / "ckpt"
        self.dir.mkdir()
        self.reports: list[tuple[int, Next]] = []
        self.loaded: list[int] = []
        self.stop = threading.Event()
        self.path = str(tmp / "control" / "node-1.sock")
        self.sup = Supervised(save=self.save, load=self.load, socket=self.path, node="node-1", job="my-job")
        self.thread = threading.Thread(target=self.run, name="user-loop", daemon=True)

    def save(self, step: int) -> None:
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict()}, self.dir / f"step-{step}.pt")

    def load(self, step: int) -> None:
        ckpt = torch.load(self.dir / f"step-{step}.pt", weights_only=True)
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["opt"])
        self.loaded.append(step)

    def run(self) -> None:
        with self.sup as sup:
            step = 0
            while not self.stop.is_set():
                x = torch.randn(8, 4)
                loss = ((self.model(x) - x.sum(1, keepdim=True)) ** 2).mean()
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                step += 1
                todo = sup.step(step, loss.item())
                self.reports.append((step, todo))
                if todo.leave:
                    return
                step = todo.step
                time.sleep(0.002)  # a step takes time, as a real one does: not a synchronisation

    def after_restore(self) -> list[int]:
        """The steps reported right after each restore."""
        return [self.reports[i + 1][0] for i, (_, t) in enumerate(self.reports[:-1]) if t.restored]


@pytest.fixture
def loop(tmp_path: Path):
    loop = Loop(tmp_path)
    loop.thread.start()
    yield loop
    loop.stop.set()
    loop.thread.join(10)


async def test_pause_checkpoint_restart_and_leave_as_the_console_sends_them(loop: Loop) -> None:
    agent = Agent(loop.path)
    agent.start()
    try:
        status = await agent.status(lambda s: (s.step or 0) >= 3 and s.loss is not None, "the loop's step and loss")
        assert status.phase == TrainerPhase.TRAINING and status.node == "node-1" and status.job == "my-job"

        await agent.send("pause")
        paused = await agent.status(lambda s: s.paused, "the loop to pause")
        assert paused.phase == TrainerPhase.PAUSED
        at = paused.step
        assert at is not None

        await agent.send("checkpoint_now")
        await agent.event("checkpoint", f"checkpoint_now at step {at}")
        assert (loop.dir / f"step-{at}.pt").exists(), "the user's save wrote the paused step"
        still = await agent.status(lambda s: s.checkpoints, "the checkpoint in the status")
        assert still.paused and still.step == at and still.checkpoints == {"1": at}

        await agent.send("resume")
        await agent.status(lambda s: not s.paused and (s.step or 0) > at + 3, "the loop to go on")

        await agent.send("restart_from", step=at)
        await agent.event("checkpoint", f"restored step {at}")
        await agent.status(lambda s: loop.after_restore(), "the step after the restore")
        assert loop.loaded == [at] and loop.after_restore() == [at + 1], "the loop goes on from the step asked"

        await agent.send("leave")
        await asyncio.to_thread(loop.thread.join, 20)
        assert not loop.thread.is_alive(), "leave ends the loop"
        last_step, last = loop.reports[-1]
        assert last.leave and (loop.dir / f"step-{last_step}.pt").exists(), "a checkpoint before leaving"
        assert not Path(loop.path).exists(), "the socket is closed"
        left = await agent.event("trainer_left", "left the job on request")
        assert left.severity == "info", "the agent sees a leave, not a fault"
    finally:
        await agent.stop()


async def test_restart_rules_and_repeated_incidents(loop: Loop) -> None:
    agent = Agent(loop.path)
    agent.start()
    try:
        await agent.status(lambda s: (s.step or 0) >= 2, "the loop to run")
        await agent.send("checkpoint_now")
        first = (await agent.status(lambda s: s.checkpoints, "a first checkpoint")).checkpoints["1"]
        await agent.status(lambda s: (s.step or 0) > first + 2, "the loop to go on")

        await agent.send("restart_from", step=10**6)
        await agent.event("checkpoint", f"restart_from: no checkpoint loads at step {10**6}")
        assert loop.loaded == [], "no step was loaded; training goes on"

        await agent.send("restart_from", checkpoint="newest", step=10**6, incident="inc-1")
        await agent.event("checkpoint", f"restored step {first}")
        assert loop.loaded == [first], "the newest saved step, when the named one does not load"

        await agent.send("restart_from", checkpoint="newest", incident="inc-1")
        await agent.send("checkpoint_now")  # taken after the repeat: once it is done, the repeat was seen
        await agent.status(lambda s: s.checkpoints["1"] > first, "a second checkpoint")
        assert loop.loaded == [first], "a repeat of inc-1 is ignored: the job does not roll back again"
    finally:
        await agent.stop()


async def test_bad_input_is_refused_and_never_acted_on(loop: Loop) -> None:
    agent = Agent(loop.path)
    agent.start()
    try:
        await agent.status(lambda s: (s.step or 0) >= 2, "the loop to run")
        reader, writer = await asyncio.open_unix_connection(loop.path)
        bad = [b"not json\n", b'{"cmd": "format_disk"}\n', b'{"cmd": "restart_from", "args": {}}\n',
               b'{"cmd": "restart_from", "args": {"checkpoint": "../../etc/passwd"}}\n',
               b'{"cmd": "restart_from", "args": {"step": -1}}\n', pickle.dumps({"cmd": "leave"}) + b"\n"]
        for line in bad:
            writer.write(line)
            await writer.drain()
            reply = await reader.readline()
            assert reply.startswith(b'{"ok":false'), (line, reply)
        writer.close()
        reply = await agent.link.control("format_disk", {})
        assert not reply["ok"] and "unknown command 'format_disk'" in reply["message"]

        before = (await agent.status(lambda s: True, "a status")).step or 0
        await agent.status(lambda s: (s.step or 0) > before + 3, "the loop to go on untouched")
        assert loop.loaded == [] and not any(loop.dir.iterdir()), "nothing was loaded or saved"
        assert not any(t.leave or t.restored for _, t in loop.reports)
    finally:
        await agent.stop()


def test_the_api_brings_no_framework_and_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; from gridwatch.trainer import Supervised; import gridwatch.trainer.adapters; "
            "print(sorted(m for m in ('torch', 'transformers', 'pytorch_lightning', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_socket_that_cannot_be_made_says_what_to_do(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    sup = Supervised(save=lambda step: None, load=lambda step: None, socket=str(not_a_dir / "t.sock"))
    with pytest.raises(OSError, match="pass socket= or set GRIDWATCH_TRAINER_SOCKET"):
        sup.start()
