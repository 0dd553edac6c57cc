"""A user's loop of two ranks under one node's socket: every rank pauses, saves, loads and stops at the same step."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from tests.support_supervised import Agent

ROOT = Path(__file__).resolve().parent.parent


async def test_two_ranks_apply_the_controls_rank_0_takes_at_the_same_step(tmp_path: Path) -> None:
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.support_supervised_rank", str(r), str(tmp_path)], cwd=ROOT)
             for r in (0, 1)]
    agent = Agent(str(tmp_path / "node.sock"))
    agent.start()
    try:
        status = await agent.status(lambda s: (s.step or 0) >= 3, "the two ranks to run")
        assert status.world_size == 2 and status.rank == 0

        await agent.send("pause")
        at = (await agent.status(lambda s: s.paused, "the job to pause")).step
        await agent.send("checkpoint_now")
        await agent.event("checkpoint", f"checkpoint_now at step {at}")
        await agent.send("restart_from", step=2)
        await agent.event("checkpoint", "restored step 2")
        await agent.send("resume")
        await agent.status(lambda s: not s.paused and (s.step or 0) > 4, "the job to go on")
        await agent.send("leave")
        codes = [await asyncio.to_thread(p.wait, 60) for p in ranks]
        assert codes == [0, 0], "leave ends every rank's loop"
    finally:
        await agent.stop()
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen[0]["steps"] == seen[1]["steps"], "the ranks stepped together"
    assert seen[0]["saves"] == seen[1]["saves"] and seen[0]["saves"][0] == at, "both saved the paused step"
    assert seen[0]["loads"] == seen[1]["loads"] == [2], "both loaded the step asked"
    assert [s["phase"] for s in seen] == ["left", "done"], "the node asked to leave left; its peer stopped with it"
