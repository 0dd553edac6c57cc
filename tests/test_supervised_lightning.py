"""A Lightning ``Trainer.fit`` under the console through the adapter's callback: a tiny random model, nothing downloaded;
pause, checkpoint_now, restart_from and leave sent as the agent sends them."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from gridwatch.wire.protocol import TrainerPhase
from tests.support_supervised import Agent

pl = pytest.importorskip("pytorch_lightning")

from gridwatch.trainer.adapters.lightning import SupervisedCallback  # noqa: E402 - needs Lightning


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen: list[int] = []  # trainer.global_step after each batch, once the callback has run

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        self.seen.append(self.trainer.global_step)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        x = torch.randn(64, 4)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def after_rewind(seen: list[int]) -> list[int] | None:
    """The first two steps from where the steps went back, once there are two."""
    steps = list(seen)
    back = next((i for i in range(1, len(steps)) if steps[i] < steps[i - 1]), None)
    return steps[back:back + 2] if back is not None and len(steps) >= back + 2 else None


async def test_a_lightning_fit_pauses_checkpoints_restarts_and_leaves(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = str(tmp_path / "control" / "node-1.sock")
    callback = SupervisedCallback(tmp_path / "ckpt", socket=path, node="node-1", job="lightning-job")
    model = Tiny()
    trainer = pl.Trainer(accelerator="cpu", max_steps=100_000, callbacks=[callback], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    fit = threading.Thread(target=trainer.fit, args=(model,), name="fit", daemon=True)
    fit.start()
    agent = Agent(path)
    agent.start()
    try:
        status = await agent.status(lambda s: (s.step or 0) >= 3 and s.loss is not None, "the fit's step and loss")
        assert status.phase == TrainerPhase.TRAINING and status.job == "lightning-job"

        await agent.send("pause")
        at = (await agent.status(lambda s: s.paused, "the fit to pause")).step
        assert at is not None
        await agent.send("checkpoint_now")
        await agent.event("checkpoint", f"checkpoint_now at step {at}")
        ckpt = tmp_path / "ckpt" / f"step-{at}.ckpt"
        assert ckpt.is_file() and torch.load(ckpt, weights_only=False)["global_step"] == at, "Lightning's own checkpoint"

        await agent.send("resume")
        await agent.status(lambda s: (s.step or 0) > at + 3, "the fit to go on")
        await agent.send("restart_from", checkpoint="newest")
        await agent.event("checkpoint", f"restored step {at}")
        await agent.status(lambda s: after_rewind(model.seen), "two steps after the restore")
        assert after_rewind(model.seen) == [at, at + 1], "global_step goes on from the step asked"

        await agent.send("leave")
        await asyncio.to_thread(fit.join, 30)
        assert not fit.is_alive() and trainer.should_stop, "leave ends the fit"
        assert (tmp_path / "ckpt" / f"step-{trainer.global_step}.ckpt").is_file(), "a checkpoint before leaving"
        assert not Path(path).exists()
        await agent.event("trainer_left", "left the job on request")
    finally:
        await agent.stop()
        trainer.should_stop = True
        fit.join(30)
