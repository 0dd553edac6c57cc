"""The settings of one training run, written once to ``RUN_DIR/config.json`` and read by every worker."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import msgspec

from trainer.private import path_refusal

CONFIG_NAME = "config.json"


def tier0_base() -> Path | None:
    """Where in-memory tiers live: ``$XDG_RUNTIME_DIR`` when it is this user's private directory, else /dev/shm.

    None when neither is usable (the run directory then holds tier 0).
    """
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg) and not path_refusal(Path(xdg)):
        return Path(xdg)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return None


class TrainConfig(msgspec.Struct, kw_only=True):
    run_dir: str
    steps: int = 300
    seed: int = 1234
    # model
    seq_len: int = 64
    dim: int = 128
    layers: int = 2
    heads: int = 4
    # data and optimisation; the global batch is micro_batch * micro_batches windows
    corpus_bytes: int = 2 << 20
    micro_batch: int = 8
    micro_batches: int = 4
    lr: float = 3e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    # "exact": gradients reduced per micro-batch so any world size gives the same bits;
    # "fast": one all-reduce of locally summed gradients (same world size: still exact).
    reduce: str = "exact"
    # tiered checkpoints: every N steps; how many to keep per tier
    tier0_every: int = 5
    tier1_every: int = 20
    tier2_every: int = 60
    keep: tuple[int, int, int] = (2, 3, 2)
    tier0_dir: str = ""  # in-memory tier (tmpfs); per node below it; default: see tier0_root()
    tier0_key: str = ""  # random, set for each new run: the default tier-0 directory's name is not guessable
    second_dir: str = ""  # tier 2 location, standing in for shared storage
    tier2_stagger_s: float = 0.5  # rank r starts its tier-2 copy r * this later
    # guards
    spike_factor: float = 4.0
    straggler_factor: float = 3.0
    straggler_window: int = 20
    progress_deadline_s: float = 15.0
    startup_deadline_s: float = 180.0
    # injected faults, for tests and demos
    fault_nan_step: int = 0
    fault_slow_rank: int = -1
    fault_slow_step: int = 0
    fault_slow_s: float = 0.0
    # the control socket: owner only (0600) by default; with a group, 0660 and its members may connect
    control_group: str = ""

    def run_id(self) -> str:
        return "gw-" + hashlib.sha1(str(Path(self.run_dir).resolve()).encode()).hexdigest()[:10]

    def tier0_root(self) -> Path:
        """The run's in-memory tier, one private directory (0700) holding a directory per node."""
        if self.tier0_dir:
            return Path(self.tier0_dir)
        base = tier0_base()
        if base is None:
            return Path(self.run_dir) / "tier0"
        return base / (self.run_id() + (f"-{self.tier0_key}" if self.tier0_key else ""))

    def tier_root(self, tier: int, node: str) -> Path:
        """Where checkpoints of ``tier`` live for ``node`` (tier 2 is shared by all nodes)."""
        if tier == 0:
            return self.tier0_root() / node
        if tier == 1:
            return Path(self.run_dir) / "nodes" / node / "ckpt"
        return Path(self.second_dir or Path(self.run_dir) / "shared") / "ckpt"


def write_config(cfg: TrainConfig) -> Path:
    path = Path(cfg.run_dir) / CONFIG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(cfg)))
    os.replace(tmp, path)
    return path


def read_config(run_dir: str | os.PathLike[str]) -> TrainConfig:
    path = Path(run_dir) / CONFIG_NAME
    try:
        return msgspec.json.decode(path.read_bytes(), type=TrainConfig)
    except FileNotFoundError:
        raise ValueError(f"{path} not found: start the run with `gridwatch train` first") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"{path} is not a valid run config: {exc}") from None
