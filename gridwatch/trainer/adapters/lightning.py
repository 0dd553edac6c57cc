"""A Lightning ``Callback`` that puts a ``Trainer.fit`` under the console (:class:`gridwatch.trainer.Supervised`).

::

    from gridwatch.trainer.adapters.lightning import SupervisedCallback

    trainer = Trainer(callbacks=[SupervisedCallback(dirpath="ckpt")])

Its checkpoints are Lightning's own (``trainer.save_checkpoint``, ``dirpath/step-N.ckpt``); a
``restart_from`` loads the model, optimizer and schedulers from one and sets ``trainer.global_step`` back,
so the run counts (and stops at ``max_steps``) from there; the data loader goes on where it was.
``save``/``load`` of your own replace them. Works with ``lightning`` or ``pytorch_lightning``, whichever the
run imported.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

from gridwatch.trainer.supervised import LoadFn, SaveFn, Supervised


def _lightning() -> Any:
    """The Lightning the run uses: the one already imported, else ``lightning``, else ``pytorch_lightning``."""
    names = ("lightning.pytorch", "pytorch_lightning")
    for name in names:
        if name in sys.modules:
            return sys.modules[name]
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("the Lightning callback needs lightning or pytorch_lightning: pip install pytorch-lightning")


_STEP_FILE = re.compile(r"^step-(\d+)\.ckpt$")


def set_global_step(trainer: Any, step: int) -> None:
    """Make ``trainer.global_step`` read ``step``: Lightning counts it in its fit loop's progress trackers."""
    loop = trainer.fit_loop.epoch_loop
    if trainer.lightning_module.automatic_optimization:
        progress = loop.automatic_optimization.optim_progress.optimizer.step.total
    else:
        progress = loop.manual_optimization.optim_step_progress.total
    progress.ready = progress.completed = step
    loop._batches_that_stepped = step  # the step the loggers write


def batch_loss(outputs: Any) -> float | None:
    """The loss ``training_step`` returned (a tensor, or a dict with ``loss``), as a number."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    try:
        return None if loss is None else float(loss)
    except (TypeError, ValueError, RuntimeError):
        return None


class SupervisedCallback(_lightning().Callback):  # type: ignore[misc]
    """Status at every ``on_train_batch_end``; pause, checkpoint_now, restart_from and leave applied there."""

    def __init__(self, dirpath: str | Path = "checkpoints", *, save: SaveFn | None = None, load: LoadFn | None = None,
                 socket: str | None = None, node: str | None = None, job: str | None = None, group: str = "") -> None:
        super().__init__()
        self.dirpath = Path(dirpath)
        self._save, self._load = save, load
        self._options: dict[str, Any] = {"socket": socket, "node": node, "job": job, "group": group}
        self._trainer: Any = None
        self.supervised: Supervised | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._trainer = trainer
        steps = None if self._load is not None else self.steps
        self.supervised = Supervised(save=self.save, load=self.load, steps=steps, serve=trainer.local_rank == 0,
                                     **self._options).start()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.supervised is None:
            return
        todo = self.supervised.step(trainer.global_step, batch_loss(outputs))
        if todo.restored:
            set_global_step(trainer, todo.step)
        if todo.leave:
            trainer.should_stop = True

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.supervised is not None:
            self.supervised.close()
            self.supervised = None

    def path(self, step: int) -> Path:
        return self.dirpath / f"step-{step}.ckpt"

    def save(self, step: int) -> None:
        if self._save is not None:
            self._save(step)
        else:
            self._trainer.save_checkpoint(self.path(step))  # every rank calls it at the same step: it may be collective

    def load(self, step: int) -> None:
        if self._load is not None:
            self._load(step)
            return
        path = self.path(step)
        if not path.is_file():
            raise FileNotFoundError(f"no checkpoint at {path}")
        strategy = self._trainer.strategy
        ckpt = strategy.load_checkpoint(path)
        strategy.load_model_state_dict(ckpt)
        strategy.load_optimizer_state_dict(ckpt)
        for config, state in zip(self._trainer.lr_scheduler_configs, ckpt.get("lr_schedulers", []), strict=False):
            config.scheduler.load_state_dict(state)

    def steps(self) -> list[int]:
        """The steps this callback's checkpoints in ``dirpath`` hold."""
        if not self.dirpath.is_dir():
            return []
        return [int(m.group(1)) for p in self.dirpath.iterdir() if (m := _STEP_FILE.match(p.name))]
