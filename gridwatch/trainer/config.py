"""The settings of one training run, written once to ``RUN_DIR/config.json`` and read by every worker.

The file decides what the trainer deletes (its tier 0), who may control it and
which faults it injects, so it is this user's alone: the run directory is made
0700 (0710 for a control group) and the file 0600 whatever the umask, and a run
directory or file that is not this user's, or that group or others can write,
is refused rather than read.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Annotated

import msgspec

from gridwatch.trainer.private import DIR_MODE, FILE_MODE, path_refusal, refusal, remove_if_empty, remove_private_dir

CONFIG_NAME = "config.json"
# A node's name: also the name of its directory under the run's tier 0.
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# What a run may leave in a tier-0 node directory: published steps and the temporaries they are written in.
_CHECKPOINT_ENTRY = re.compile(r"^\.?step-\d{8}(\.tmp-\d+-\d+)?$")
_DERIVED_TIER0 = re.compile(r"^gw-[0-9a-f]{10}(-[0-9a-f]{1,32})?$")
# Bits a run directory and its config must not have: nobody else may change what the trainer reads.
_NO_WRITERS = 0o022
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class ConfigRefused(ValueError):
    """A run directory or config another user could have written; the message says why in one line."""


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
    # random, set for each new run: the default tier-0 directory's name is not guessable (and climbs nowhere)
    tier0_key: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{0,32}$")] = ""
    second_dir: str = ""  # tier 2 location, standing in for shared storage
    tier2_stagger_s: float = 0.5  # rank r starts its tier-2 copy r * this later
    # guards
    spike_factor: float = 4.0
    straggler_factor: float = 3.0
    straggler_window: int = 20
    # A straggler episode (told once): this many slow steps, spanning at least this long, half the steps between
    # its first and last; over after this many steps at pace.
    straggler_min_steps: int = 5
    straggler_min_span_s: float = 120.0
    straggler_rest_steps: int = 50
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
        return self.derived_tier0_root()

    def derived_tier0_root(self) -> Path:
        """The default tier 0: ``BASE/gw-<run>-<key>``, a name made from the run and its random key alone."""
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


def release_tier0(cfg: TrainConfig, node: str | None = None) -> list[str]:
    """Give back the run's in-memory tier (or ``node``'s part of it); returns why anything was left.

    Only what a run makes there is removed: the default directory (named after
    the run and its key) whole, or, under a configured ``tier0_dir``, the
    checkpoints in its node directories, then what they leave empty. A
    configured path is never removed with whatever else it holds: it came
    from a file, and a wrong one must not cost a home directory.
    """
    root = cfg.tier0_root()
    if node is not None and not NODE_NAME.match(node):
        return [f"{root / node} is not a node's tier-0 directory"]
    if not cfg.tier0_dir and _DERIVED_TIER0.match(root.name) and root.parent == tier0_base():
        if node is None:
            why = remove_private_dir(root)
            return [why] if why else []
        why = remove_private_dir(root / node)
        remove_if_empty(root)
        return [why] if why else []
    left: list[str] = []
    if path_refusal(root):
        return left  # missing, or not ours: nothing of this run's is in it
    names = [node] if node is not None else sorted(os.listdir(root))
    for name in names:
        node_dir = root / name
        if not NODE_NAME.match(name) or path_refusal(node_dir):
            continue
        removed = False
        for entry in sorted(os.listdir(node_dir)):
            if _CHECKPOINT_ENTRY.match(entry):
                why = remove_private_dir(node_dir / entry)
                if why:
                    left.append(why)
                else:
                    removed = True
        if removed or node is not None:
            remove_if_empty(node_dir)
    remove_if_empty(root)
    return left


def make_run_dir(run_dir: Path, gid: int | None = None) -> Path:
    """Create ``run_dir`` 0700 (0710 and group ``gid``, the control group's way to its sockets) whatever the umask.

    An existing one is kept if it is this user's and nobody else can write it;
    anything else raises :class:`ConfigRefused`. Its parents are made with the usual modes.
    """
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    mode = DIR_MODE if gid is None else 0o710
    try:
        os.mkdir(run_dir, mode)
        created = True
    except FileExistsError:
        created = False
    fd = _open_run_dir(run_dir)
    try:
        if created:
            os.fchmod(fd, mode)
        if gid is not None:
            st = os.fstat(fd)
            if st.st_gid != gid:
                os.fchown(fd, -1, gid)
            if not st.st_mode & 0o010:
                os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o010)
    finally:
        os.close(fd)
    return run_dir


def make_run_subdir(path: Path) -> Path:
    """A directory inside the run directory, 0700 when made now; one already there is left as it is."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return path
    os.chmod(path, DIR_MODE)  # mkdir applied the umask
    return path


def _open_run_dir(run_dir: Path) -> int:
    """A descriptor on ``run_dir``, checked to be this user's and closed to writers; raises ConfigRefused."""
    try:
        fd = os.open(run_dir, _OPEN_DIR)
    except NotADirectoryError:
        raise ConfigRefused(f"refusing the run directory {run_dir}: it is not a directory") from None
    try:
        why = refusal(os.fstat(fd), want_dir=True, closed=_NO_WRITERS)
        if why:
            raise ConfigRefused(f"refusing the run directory {run_dir}: it {why}, so another user could change "
                                "the run's settings (chmod go-w it, or choose a new --run-dir)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_config(cfg: TrainConfig) -> Path:
    """Write ``RUN_DIR/config.json`` 0600, replacing the old one in one step; never through a link."""
    run_dir = Path(cfg.run_dir)
    if not run_dir.exists():
        make_run_dir(run_dir)
    fd = _open_run_dir(run_dir)
    tmp = f".{CONFIG_NAME}.{secrets.token_hex(4)}.tmp"
    try:
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=fd)
        try:
            os.fchmod(out, FILE_MODE)
            view = memoryview(msgspec.json.format(msgspec.json.encode(cfg)))
            while view:
                view = view[os.write(out, view):]
            os.fsync(out)
        finally:
            os.close(out)
        os.replace(tmp, CONFIG_NAME, src_dir_fd=fd, dst_dir_fd=fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=fd)
        except OSError:
            pass
        raise
    finally:
        os.close(fd)
    return run_dir / CONFIG_NAME


def read_config(run_dir: str | os.PathLike[str]) -> TrainConfig:
    """The run's config; ValueError (:class:`ConfigRefused` when another user could have written it) in one line."""
    path = Path(run_dir) / CONFIG_NAME
    try:
        fd = _open_run_dir(Path(run_dir))
    except FileNotFoundError:
        raise ValueError(f"{path} not found: start the run with `gridwatch train` first") from None
    try:
        try:
            cfd = os.open(CONFIG_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except FileNotFoundError:
            raise ValueError(f"{path} not found: start the run with `gridwatch train` first") from None
        except OSError:
            st = os.stat(CONFIG_NAME, dir_fd=fd, follow_symlinks=False)
            why = refusal(st, want_dir=False, closed=_NO_WRITERS) or "cannot be opened"
            raise ConfigRefused(f"refusing {path}: it {why}") from None
        with os.fdopen(cfd, "rb") as f:
            why = refusal(os.fstat(f.fileno()), want_dir=False, closed=_NO_WRITERS)
            if why:
                raise ConfigRefused(f"refusing {path}: it {why}, so another user could have set what the trainer "
                                    "deletes and who controls it (check the run, then write a new one with `gridwatch train`)")
            data = f.read()
    finally:
        os.close(fd)
    try:
        return msgspec.json.decode(data, type=TrainConfig)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"{path} is not a valid run config: {exc}") from None
