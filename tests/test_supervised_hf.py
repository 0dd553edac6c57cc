"""A Hugging Face ``Trainer.train`` under the console through the adapter's callback: a tiny GPT-2 built from a config
(random weights, nothing downloaded); pause, checkpoint_now, restart_from and leave sent as the agent sends them."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from gridwatch.wire.protocol import TrainerPhase
from tests.support_supervised import Agent

transformers = pytest.importorskip("transformers")

from gridwatch.trainer.adapters.hf import SupervisedCallback  # noqa: E402 - needs transformers


class Steps(transformers.TrainerCallback):
    """``state.global_step`` after each step, once the supervising callback has run."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seen.append(state.global_step)


def after_rewind(seen: list[int]) -> list[int] | None:
    """The first two steps from where the steps went back, once there are two."""
    steps = list(seen)
    back = next((i for i in range(1, len(steps)) if steps[i] < steps[i - 1]), None)
    return steps[back:back + 2] if back is not None and len(steps) >= back + 2 else None


def tiny_trainer(out: Path, callbacks: list[Any]) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (64, 16))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=100_000, per_device_train_batch_size=4,
                                          logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                                          disable_tqdm=True, dataloader_num_workers=0)
    return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


async def test_a_hugging_face_run_pauses_checkpoints_restarts_and_leaves(tmp_path: Path) -> None:
    path = str(tmp_path / "control" / "node-1.sock")
    steps = Steps()
    trainer = tiny_trainer(tmp_path / "out", [SupervisedCallback(socket=path, node="node-1", job="hf-job"), steps])
    train = threading.Thread(target=trainer.train, name="train", daemon=True)
    train.start()
    agent = Agent(path)
    agent.start()
    try:
        status = await agent.status(lambda s: (s.step or 0) >= 3 and s.loss is not None, "the run's step and loss")
        assert status.phase == TrainerPhase.TRAINING and status.job == "hf-job"

        await agent.send("pause")
        at = (await agent.status(lambda s: s.paused, "the run to pause")).step
        assert at is not None
        await agent.send("checkpoint_now")
        await agent.event("checkpoint", f"checkpoint_now at step {at}")
        ckpt = tmp_path / "out" / f"checkpoint-{at}"
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= {p.name for p in ckpt.iterdir()}

        await agent.send("resume")
        await agent.status(lambda s: (s.step or 0) > at + 3, "the run to go on")
        await agent.send("restart_from", step=at)
        await agent.event("checkpoint", f"restored step {at}")
        await agent.status(lambda s: after_rewind(steps.seen), "two steps after the restore")
        assert after_rewind(steps.seen) == [at, at + 1], "global_step goes on from the step asked"

        await agent.send("leave")
        await asyncio.to_thread(train.join, 30)
        assert not train.is_alive(), "leave ends the run"
        assert (tmp_path / "out" / f"checkpoint-{trainer.state.global_step}" / "model.safetensors").is_file()
        assert not Path(path).exists()
        await agent.event("trainer_left", "left the job on request")
    finally:
        await agent.stop()
        trainer.control.should_training_stop = True
        train.join(30)
