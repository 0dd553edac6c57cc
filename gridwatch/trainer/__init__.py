"""The supervised trainer: elastic data-parallel workers, tiered checkpoints, a local control socket.

For a training loop of your own, :class:`Supervised` serves the same control socket (see docs/trainer.md);
the Lightning and Hugging Face callbacks are in :mod:`gridwatch.trainer.adapters`.
"""

from gridwatch.trainer.supervised import Next, Supervised

__all__ = ["Next", "Supervised"]
