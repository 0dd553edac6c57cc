"""Launch a training run on this machine: the job's store and one torchrun agent per simulated node.

Two ways to keep the job's members (``membership``):

- ``coordinator`` (the default): each node's torchrun only supervises its own
  worker (a one-node rendezvous in the job's store, restarting it if it dies); the coordinator beside
  the store decides who trains in each generation, and a change of members
  re-forms the job in place (:mod:`gridwatch.trainer.membership`).
- ``torchrun``: TorchElastic's own c10d rendezvous across the nodes; any change
  of members restarts every worker. Kept as the baseline it is measured against.

This module does not import torch, so a console or demo process can start and
supervise a run without loading it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from loguru import logger

from gridwatch.trainer import config
from gridwatch.trainer.config import (
    NODE_NAME,
    ConfigRefused,
    TrainConfig,
    make_run_dir,
    make_run_subdir,
    read_config,
    write_config,
)
from gridwatch.trainer.control_server import resolve_group
from gridwatch.trainer.membership import STORE_ENV
from gridwatch.trainer.private import NotPrivate, make_private_dir, path_refusal
from gridwatch.wire.controlsock import socket_path

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# Rendezvous settings tuned for fast re-forming: a dead node's heartbeat expires
# after ~3 s instead of 15, and a re-formed group waits 2 s for late joiners
# instead of 30. The store is the launcher's, never a training node's.
TUNED_RDZV = {
    "is_host": "false",
    "join_timeout": "600",
    "last_call_timeout": "2",
    "close_timeout": "10",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "3",
}
DEFAULT_RDZV = {"is_host": "false"}
# torchrun's rank-0 agent would host a TCPStore for the workers on every interface; the workers use the
# job's store (gridwatch.trainer.group), so that one is turned off.
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class LaunchError(ValueError):
    """A run that cannot start; the message says what to do, in one line."""


def node_names(count: int, names: list[str] | None = None) -> list[str]:
    if names is None:
        return [f"node-{i}" for i in range(1, count + 1)]
    if len(names) != count:
        raise LaunchError(f"--node-names lists {len(names)} names for --nodes {count}")
    for name in names:
        if not NODE_NAME.match(name):
            raise LaunchError(f"node name {name!r} is not allowed (letters, digits, '_', '.', '-')")
    if len(set(names)) != len(names):
        raise LaunchError("node names must be unique")
    return names


MEMBERSHIPS = ("coordinator", "torchrun")
REJOIN_DIR = "rejoin"  # RUN_DIR/rejoin/<node>: a repaired node to start again (see request_rejoin)
REJOIN_KEEP_S = 30.0  # a request for a node still running waits this long for it to exit


def request_rejoin(run_dir: str | os.PathLike[str], node: str) -> Path:
    """Ask the run's launcher to start ``node`` again; it does so within a second."""
    if not NODE_NAME.match(node):
        raise LaunchError(f"node name {node!r} is not allowed")
    path = Path(run_dir) / REJOIN_DIR / node
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


def torchrun_command(
    cfg: TrainConfig, endpoint: str, min_nodes: int, max_nodes: int, rdzv: str = "tuned",
    python: str = sys.executable, membership: str = "coordinator", node: str = "$(hostname)",
    start: str = "$RANDOM$RANDOM",
) -> list[str]:
    """torchrun's argv for one node. Its agent never hosts a store: the rendezvous is the job's own store
    (which listens only where it is told), and with AGENT_ENV torchrun starts no shared store of its own,
    where either would listen, unauthenticated, on every interface."""
    if membership == "coordinator":
        # One node's worker, restarted by torchrun if it dies; membership is the coordinator's. A
        # rendezvous of one node in the job's store stands in for --standalone's own store; its id is new
        # at each start (``start``), since torchrun closes a rendezvous it finished and a rejoin needs one.
        return [
            python, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={cfg.run_id()}-{node}-{start}",
            "--rdzv-conf=is_host=false", "--max-restarts=100", "--monitor-interval=0.2",
            "-m", "gridwatch.trainer.worker", "--run-dir", str(Path(cfg.run_dir).resolve()),
        ]
    conf = TUNED_RDZV if rdzv == "tuned" else DEFAULT_RDZV
    # On one machine the ranks' group is hosted on loopback (MASTER_ADDR); on a cluster, on the node's address.
    local = ["--local-addr=127.0.0.1"] if endpoint.startswith("127.0.0.1:") else []
    return [
        python, "-m", "torch.distributed.run",
        f"--nnodes={min_nodes}:{max_nodes}", "--nproc-per-node=1", *local,
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={cfg.run_id()}",
        "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in conf.items()),
        "--max-restarts=100",
        "-m", "gridwatch.trainer.worker", "--run-dir", str(Path(cfg.run_dir).resolve()),
    ]


def _start_store(python: str, log: Path, coordinator: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen(
        [python, "-m", "gridwatch.trainer.store", "--port", "0", *coordinator],
        stdout=subprocess.PIPE, stderr=open(log, "ab"), cwd=PROJECT_ROOT, start_new_session=True,
        env=_env(), preexec_fn=_die_with_launcher,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    if not line.isdigit():
        proc.kill()
        raise LaunchError(f"the rendezvous store did not start (see {log})")
    return proc, int(line)


def _die_with_launcher() -> None:
    """Runs in the child before exec: SIGTERM it if the launcher dies, so no node outlives its run."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(AGENT_ENV)
    env.update(extra or {})
    return env


@dataclass
class LocalRun:
    """A run in progress: the store, and per node its torchrun agent (with its worker)."""

    cfg: TrainConfig
    store: subprocess.Popen[bytes]
    port: int
    nodes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)
    membership: str = "coordinator"

    def _spawn(self, name: str) -> None:
        logs = self.run_dir / "logs"
        env = {"GRIDWATCH_NODE": name}
        if self.membership == "coordinator":
            env[STORE_ENV] = f"127.0.0.1:{self.port}"
        argv = self.commands[name]
        if self.membership == "coordinator":
            # A fresh one-node rendezvous for each start of the node (see torchrun_command).
            argv = [f"{a.rsplit('-', 1)[0]}-{secrets.token_hex(4)}" if a.startswith("--rdzv-id=") else a for a in argv]
        self.nodes[name] = subprocess.Popen(
            argv, cwd=PROJECT_ROOT, start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=open(logs / f"{name}.log", "ab"), stderr=subprocess.STDOUT,
            env=_env(env), preexec_fn=_die_with_launcher,
        )

    def take_rejoins(self) -> list[str]:
        """Start every node asked for by :func:`request_rejoin`; returns those started."""
        started = []
        for path in sorted((self.run_dir / REJOIN_DIR).glob("*")):
            try:
                if self.add_node(path.name):
                    started.append(path.name)
                elif time.time() - path.stat().st_mtime < REJOIN_KEEP_S:
                    continue  # still leaving: start it once it is gone
            except (LaunchError, FileNotFoundError) as exc:
                logger.warning("rejoin {}: {}", path.name, exc)
            path.unlink(missing_ok=True)
        return started

    def add_node(self, name: str) -> bool:
        """Start ``name``'s torchrun agent again (a repaired node rejoining); False if it is running.

        Under the coordinator the node joins the running job at its next step;
        under torchrun's rendezvous every worker restarts to take it in.
        """
        proc = self.nodes.get(name)
        if proc is not None and proc.poll() is None:
            return False
        if name not in self.commands:
            raise LaunchError(f"{name} is not a node of this run")
        logger.bind(node=name).info("node rejoins the run")
        self._spawn(name)
        return True

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def socket_path(self, node: str) -> str:
        return socket_path(self.run_dir, node)

    def _signal(self, node: str, sig: int) -> None:
        """Signal the node's agent and every process under it (torchrun gives workers their own session)."""
        proc = self.nodes[node]
        try:
            tree = [psutil.Process(proc.pid)]
            tree += tree[0].children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        # The agent first, so that it cannot restart the workers it sees dying.
        for p in tree:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def kill_node(self, node: str) -> None:
        """Lose a node: SIGKILL its torchrun agent and workers together."""
        logger.bind(node=node).warning("killing node (agent and workers)")
        self._signal(node, signal.SIGKILL)

    def freeze_node(self, node: str) -> None:
        """Freeze a node (SIGSTOP): its sockets stay open but it makes no progress."""
        self._signal(node, signal.SIGSTOP)

    def thaw_node(self, node: str) -> None:
        self._signal(node, signal.SIGCONT)

    def alive(self) -> list[str]:
        return [n for n, p in self.nodes.items() if p.poll() is None]

    def last_step(self) -> int:
        return last_metric_step(self.metrics_path)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for every node to exit; 0 when the run reached its last step, 1 otherwise."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for proc in self.nodes.values():
            left = None if deadline is None else max(0.1, deadline - time.monotonic())
            try:
                proc.wait(left)
            except subprocess.TimeoutExpired:
                return 1
        self._stop_store()
        if self.last_step() < self.cfg.steps:
            return 1  # tier 0 stays for a --resume
        release_tier0(self.cfg)
        return 0

    def stop(self, grace: float = 10.0) -> None:
        """Stop every node (SIGTERM, then SIGKILL after ``grace``) and the store.

        An interrupted run keeps its tier 0 (private to this user) for ``--resume``;
        one that had finished gives it back.
        """
        for node, proc in self.nodes.items():
            if proc.poll() is None:
                self._signal(node, signal.SIGCONT)
                self._signal(node, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for node, proc in self.nodes.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(node, signal.SIGKILL)
                proc.wait()
        self._stop_store()
        if self.last_step() >= self.cfg.steps:
            release_tier0(self.cfg)

    def _stop_store(self) -> None:
        if self.store.poll() is None:
            self.store.terminate()
            try:
                self.store.wait(5)
            except subprocess.TimeoutExpired:
                self.store.kill()


def last_metric_step(path: Path) -> int:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def has_checkpoints(cfg: TrainConfig) -> bool:
    run_dir = Path(cfg.run_dir)
    shared = Path(cfg.second_dir) if cfg.second_dir else run_dir / "shared"
    return any(run_dir.glob("nodes/*/ckpt/step-*")) or any((shared / "ckpt").glob("step-*"))


def refused_checkpoint(cfg: TrainConfig) -> str:
    """The first tier-1 or tier-2 checkpoint path of this run that a restore would refuse (not private), with why; '' if none."""
    run_dir = Path(cfg.run_dir)
    shared = Path(cfg.second_dir) if cfg.second_dir else run_dir / "shared"
    for root in [*sorted(run_dir.glob("nodes/*/ckpt")), shared / "ckpt"]:
        why = path_refusal(root)
        if why == "is missing":
            continue
        if why:
            return f"{root} {why}"
        for step in sorted(root.glob("step-*")):
            why = path_refusal(step)
            if why:
                return f"{step} {why}"
            for file in sorted(step.iterdir()):
                why = path_refusal(file, want_dir=False)
                if why:
                    return f"{file} {why}"
    return ""


def release_tier0(cfg: TrainConfig) -> None:
    """Give back the run's in-memory tier (a finished run keeps its last checkpoint in tiers 1 and 2)."""
    for why in config.release_tier0(cfg):
        logger.warning("tier 0 left in place: {}", why)


def prepare(cfg: TrainConfig, resume: bool, local: bool = True) -> TrainConfig:
    """Check the run directory and write the run's config; returns the config the workers will read.

    With ``local`` (nodes on this machine) the run's tier-0 directory is made
    here, private; one that is not this user's private directory stops the run.
    So does a run directory or config another user could have written: the
    config says what the trainer deletes and who may control it.
    """
    run_dir = Path(cfg.run_dir)
    if resume:
        try:
            old = read_config(run_dir)
        except ValueError as exc:
            raise LaunchError(f"cannot resume: {exc}") from None
        old.steps = cfg.steps
        cfg = old
        refused = refused_checkpoint(cfg)
        if refused:
            # Going on would restart from an older checkpoint, or from step 0, without a word here.
            raise LaunchError(f"cannot resume: {refused}, and checkpoints another user could have written are never loaded "
                              "(if you know it is yours, chmod -R go= it)")
    elif has_checkpoints(cfg):
        raise LaunchError(f"{run_dir} already holds checkpoints: pass --resume to continue it, or choose a new --run-dir")
    else:
        # A fresh run must not restore an older run's in-memory tier: it gets a new one, and the old one is given back.
        try:
            release_tier0(read_config(run_dir))
        except ConfigRefused as exc:
            raise LaunchError(str(exc)) from None
        except ValueError:
            pass  # no earlier run here, or its config is unreadable: no tier 0 of its to give back
        release_tier0(cfg)
        cfg.tier0_key = secrets.token_hex(8)
        try:
            (run_dir / "metrics.jsonl").unlink()
        except FileNotFoundError:
            pass
    gid = None
    if local and cfg.control_group:
        try:
            gid = resolve_group(cfg.control_group)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
    try:
        make_run_dir(run_dir, gid)
    except ConfigRefused as exc:
        raise LaunchError(str(exc)) from None
    make_run_subdir(run_dir / "logs")
    if not cfg.second_dir:
        make_run_subdir(run_dir / "shared")
    if local:
        try:
            make_private_dir(cfg.tier0_root(), parents=True)
        except NotPrivate as exc:
            raise LaunchError(f"refusing the in-memory checkpoint directory: {exc} (remove it, or find out who made it)") from None
    try:
        write_config(cfg)
    except ConfigRefused as exc:
        raise LaunchError(str(exc)) from None
    return cfg


def start_local_run(
    cfg: TrainConfig,
    names: list[str],
    *,
    resume: bool = False,
    min_nodes: int = 1,
    rdzv: str = "tuned",
    python: str = sys.executable,
    membership: str = "coordinator",
) -> LocalRun:
    """Start ``len(names)`` simulated nodes training ``cfg`` on this machine; returns at once.

    Node ``names[i]`` runs one torchrun agent (``GRIDWATCH_NODE=name``) with one
    worker, serving its control socket at ``RUN_DIR/control/<name>.sock``.
    Raises :class:`LaunchError` when the run directory or settings are unusable.
    """
    if not names:
        raise LaunchError("a run needs at least one node")
    if membership not in MEMBERSHIPS:
        raise LaunchError(f"membership {membership!r}: choose one of {', '.join(MEMBERSHIPS)}")
    cfg = prepare(cfg, resume)
    logs = Path(cfg.run_dir) / "logs"
    low = min(min_nodes, len(names))
    coordinator = (["--min-nodes", str(low), "--max-nodes", str(len(names))] if membership == "coordinator"
                   else ["--no-coordinator"])
    store, port = _start_store(python, logs / "store.log", coordinator)
    run = LocalRun(cfg=cfg, store=store, port=port, membership=membership)
    for name in names:
        run.commands[name] = torchrun_command(cfg, f"127.0.0.1:{port}", low, len(names), rdzv, python, membership,
                                              node=name)
        run._spawn(name)
    logger.info("run {} started: {} nodes, store on 127.0.0.1:{} ({})", cfg.run_id(), len(names), port, membership)
    return run


def cluster_command(cfg: TrainConfig, nodes: int, min_nodes: int = 1, store_host: str = "STORE_HOST",
                    membership: str = "coordinator") -> str:
    """What to run for a real cluster: the store on a host outside the job, then torchrun on each node."""
    cmd = torchrun_command(cfg, f"{store_host}:29400", min_nodes, nodes, "tuned", "python", membership)
    cmd = ["torchrun", *cmd[3:]]
    if membership != "coordinator":
        # Rank 0 hosts the group's store on this address only: the node's own, not what its name resolves
        # to (127.0.1.1 on a default Debian /etc/hosts).
        cmd.insert(3, "--local-addr=$(hostname -I | cut -d' ' -f1)")
    if membership == "coordinator":
        return "\n".join([
            f"# on {store_host} (not a training node): the store and the membership coordinator",
            f"python -m gridwatch.trainer.store --host {store_host} --port 29400 --min-nodes {min_nodes} --max-nodes {nodes}",
            "# on each node, after writing the run's config with `gridwatch train ... --print-torchrun`:",
            f"{STORE_ENV}={store_host}:29400 GRIDWATCH_NODE=$(hostname) {_env_words()}" + " ".join(cmd),
        ])
    return "\n".join([
        f"# on {store_host} (not a training node): python -m gridwatch.trainer.store --host {store_host} --port 29400 --no-coordinator",
        "# on each node, after writing the run's config with `gridwatch train ... --print-torchrun`:",
        f"GRIDWATCH_NODE=$(hostname) {_env_words()}" + " ".join(cmd),
    ])


def _env_words() -> str:
    return "".join(f"{k}={v} " for k, v in AGENT_ENV.items())
