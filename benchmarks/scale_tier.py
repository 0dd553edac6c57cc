"""The fleet a console-scale bench drives on this machine's loopback: swarm processes of agents and relays.

benchmarks/swarm.py is a process of simulated agents, driven on stdin (``pause``, ``resume``, ``xid``); a
relay is a real ``gridwatch relay``. Here they are started, asked and measured from the bench's side.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from measure import ROOT, stop_all

PER_PROCESS = 250  # agents a swarm process holds


def ask(proc: subprocess.Popen, command: str) -> str:
    proc.stdin.write(command + "\n")  # type: ignore[union-attr]
    proc.stdin.flush()  # type: ignore[union-attr]
    return proc.stdout.readline().strip()  # type: ignore[union-attr]


# The swarm and the relays stand for other machines (the nodes, the racks' head nodes) but share this one's two
# cores with the console; ``--others-nice N`` runs them at a lower priority (measured: it moves nothing here).
OTHERS_NICE = [0]


def _as_other_machine() -> None:
    if OTHERS_NICE[0]:
        os.nice(OTHERS_NICE[0])


def start_swarm(count: int, base_port: int, keys_dir: Path, lean: bool = True,
                logs: Path | None = None) -> list[subprocess.Popen]:
    procs = []
    for start in range(0, count, PER_PROCESS):
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "swarm.py"), "--control", "--count", str(min(PER_PROCESS, count - start)),
             "--base-port", str(base_port + start), "--keys", str(keys_dir), *(["--lean"] if lean else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=_as_other_machine,
            stderr=(logs / f"swarm-{start}.log").open("w") if logs else subprocess.DEVNULL))
    for proc in procs:
        if not proc.stdout.readline().startswith("ready"):  # type: ignore[union-attr]
            stop_all(procs)
            raise RuntimeError(f"a swarm process did not start{f': see {logs}' if logs else ''}")
    return procs


@dataclass
class Relay:
    """One ``gridwatch relay`` process of the bench, and the nodes it carries."""

    proc: subprocess.Popen
    address: str  # host:port it listens on
    nodes: str  # hostlist of the agents it carries
    count: int
    name: str

    def cpu(self) -> float:
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def rss_mb(self) -> float:
        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def forwarded(self, logs: Path) -> tuple[int, int] | None:
        """Once stopped: the frames it forwarded to consoles and the writes they took, over its life (its last log line)."""
        found = re.findall(r"(\d+) frames forwarded in (\d+) writes", (logs / f"{self.name}.log").read_text(errors="replace"))
        return (int(found[-1][0]), int(found[-1][1])) if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


RELAY_ENV: dict[str, str] = {}  # --relay-read-every: the relays' environment over the bench's


def start_relays(count: int, agents: int, base_port: int, keys_dir: Path, logs: Path, timeout: float = 60) -> list[Relay]:
    """``count`` relays on loopback, each carrying a contiguous share of the agents, listening before this returns.

    The bench's key directory serves as theirs: the agents' shared host key is each relay's host key
    (known_hosts pins it for every address), the operator key its client key to the agents.
    """
    relays: list[Relay] = []
    for i in range(count):
        first, last = base_port + i * agents // count, base_port + (i + 1) * agents // count - 1
        port = _free_port()
        nodes = f"127.0.0.1:[{first}-{last}]"
        proc = subprocess.Popen(
            [sys.executable, "-m", "gridwatch", "relay", "--listen", f"127.0.0.1:{port}", "--nodes", nodes,
             "--name", f"relay{i + 1}", "--keys", str(keys_dir)],
            cwd=ROOT, env={**os.environ, **RELAY_ENV}, stdin=subprocess.DEVNULL, stdout=(logs / f"relay{i + 1}.out").open("w"),
            preexec_fn=_as_other_machine,
            stderr=(logs / f"relay{i + 1}.log").open("w"))
        relays.append(Relay(proc, f"127.0.0.1:{port}", nodes, last - first + 1, f"relay{i + 1}"))
    deadline = time.monotonic() + timeout
    for i, relay in enumerate(relays):
        while not _listening(int(relay.address.rsplit(":", 1)[1])):
            if relay.proc.poll() is not None or time.monotonic() > deadline:
                stop_all([r.proc for r in relays])
                raise RuntimeError(f"relay{i + 1} did not start listening: see {logs / f'relay{i + 1}.log'}")
            time.sleep(0.2)
    return relays


def pause(swarm: list[subprocess.Popen]) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """Frames each node sent to each kind of subscriber; and (lean swarm) the ticks due, ticked, agents short."""
    sent: dict[str, dict[str, int]] = {}
    ticks = {"due": 0, "ticked": 0, "agents_short": 0}
    for proc in swarm:
        answer = json.loads(ask(proc, "pause"))
        if "error" in answer:
            raise RuntimeError(f"the agents could not write out what they published: {answer['error']}")
        sent.update(answer["sent"])
        for k, v in answer.get("ticks", {}).items():
            ticks[k] += v
    return sent, ticks


def xid_targets(agents: int, xids: int, round_no: int, base_port: int) -> list[int]:
    """The ports to inject an XID on: spread over the swarm's processes and over the tick's slots.

    A swarm process ticks its agents one after another across the interval, and the XIDs are injected a
    whole number of intervals apart: each agent's wait for the tick that reads its GPU's events is its slot
    against that moment. Agents 0, 500, 1000... of a 2,500 swarm are each the first of a process of 250, all
    on the same slot: every XID waited a whole tick (1.04 s). The slots taken here are spread over the
    interval, so the median waits half a tick, as an XID at a random moment does. Each round its own nodes:
    a GPU that fell off the bus says XID 79 once.
    """
    procs = -(-agents // PER_PROCESS)
    out = []
    for i in range(xids):
        proc = i * procs // xids
        size = min(PER_PROCESS, agents - proc * PER_PROCESS)
        out.append(base_port + proc * PER_PROCESS + ((2 * i + 1) * size // (2 * xids) + round_no) % size)
    return out
