"""Callbacks that put a Lightning or Hugging Face run under the console: each imports its library only when used.

``gridwatch.trainer.adapters.lightning.SupervisedCallback`` (a Lightning ``Callback``) and
``gridwatch.trainer.adapters.hf.SupervisedCallback`` (a Transformers ``TrainerCallback``) drive
:class:`gridwatch.trainer.Supervised` from the hooks their users already know. Nothing here is imported by
gridwatch itself: neither library is a dependency.
"""
