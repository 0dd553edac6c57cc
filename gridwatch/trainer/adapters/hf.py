"""A Hugging Face ``TrainerCallback`` that puts a ``Trainer.train`` under the console (:class:`gridwatch.trainer.Supervised`).

::

    from gridwatch.trainer.adapters.hf import SupervisedCallback

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[SupervisedCallback()])

A checkpoint_now writes ``output_dir/checkpoint-N`` in the Trainer's own layout (the model's
``save_pretrained``, ``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json``) at once, so
``resume_from_checkpoint`` can start from it too; a ``restart_from`` loads the model, optimizer and
scheduler from one and sets ``state.global_step`` back, so the run counts (and stops at ``max_steps``)
from there; the data goes on where it was. The loss is the newest one the Trainer logged (``logging_steps``).
For an optimizer the ranks shard (DeepSpeed, FSDP), pass ``save``/``load`` of your own.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from gridwatch.trainer.supervised import LoadFn, SaveFn, Supervised

# The Trainer's own names in a checkpoint directory.
CHECKPOINT_PREFIX = "checkpoint-"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


class SupervisedCallback(TrainerCallback):
    """Status at every ``on_step_end``; pause, checkpoint_now, restart_from and leave applied there."""

    def __init__(self, *, save: SaveFn | None = None, load: LoadFn | None = None, socket: str | None = None,
                 node: str | None = None, job: str | None = None, group: str = "") -> None:
        self._save, self._load = save, load
        self._options: dict[str, Any] = {"socket": socket, "node": node, "job": job, "group": group}
        self._args: Any = None
        self._state: Any = None
        self._parts: dict[str, Any] = {}  # model, optimizer, lr_scheduler: what the Trainer hands its callbacks
        self._loss: float | None = None
        self.supervised: Supervised | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._args, self._state = args, state
        steps = None if self._load is not None else self.steps
        self.supervised = Supervised(save=self.save, load=self.load, steps=steps, serve=state.is_local_process_zero,
                                     **self._options).start()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        loss = (logs or {}).get("loss")
        if isinstance(loss, int | float):
            self._loss = float(loss)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.supervised is None:
            return
        self._parts = {k: kwargs.get(k) for k in ("model", "optimizer", "lr_scheduler")}  # the Trainer may wrap them late
        todo = self.supervised.step(state.global_step, self._loss)
        if todo.restored:
            state.global_step = todo.step
        if todo.leave:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.supervised is not None:
            self.supervised.close()
            self.supervised = None

    def path(self, step: int) -> Path:
        return Path(self._args.output_dir) / f"{CHECKPOINT_PREFIX}{step}"

    def save(self, step: int) -> None:
        if self._save is not None:
            self._save(step)
            return
        import torch

        out = self.path(step)
        model, optimizer, scheduler = self._parts["model"], self._parts["optimizer"], self._parts["lr_scheduler"]
        if self._state.is_world_process_zero:  # the ranks of a data-parallel job hold the same state
            out.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(out)
            if optimizer is not None:
                torch.save(optimizer.state_dict(), out / OPTIMIZER_FILE)
            if scheduler is not None:
                torch.save(scheduler.state_dict(), out / SCHEDULER_FILE)
            self._state.save_to_json(str(out / STATE_FILE))

    def load(self, step: int) -> None:
        if self._load is not None:
            self._load(step)
            return
        import torch
        from safetensors.torch import load_file

        src = self.path(step)
        weights = src / "model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"no checkpoint at {src}")
        model, optimizer, scheduler = self._parts["model"], self._parts["optimizer"], self._parts["lr_scheduler"]
        # Not strict, as the Trainer's own resume: a tied weight (an LM head) is saved once, under its first name.
        model.load_state_dict(load_file(str(weights)), strict=False)
        if optimizer is not None and (src / OPTIMIZER_FILE).is_file():
            optimizer.load_state_dict(torch.load(src / OPTIMIZER_FILE, weights_only=True))
        if scheduler is not None and (src / SCHEDULER_FILE).is_file():
            scheduler.load_state_dict(torch.load(src / SCHEDULER_FILE, weights_only=True))

    def steps(self) -> list[int]:
        """The steps of the Trainer's checkpoints in ``output_dir``."""
        root = Path(self._args.output_dir)
        if not root.is_dir():
            return []
        return [int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
