"""A scene off its node: capture to the whole bundle in the console's store, for a 64 MB bundle on loopback.

A real agent process (``gridwatch agent``, simulated GPUs) on a loopback port; the console's fleet link and
its SceneKeeper in this process, as the runtime runs them. Each run captures a scene (``capture_scene``),
puts a core file of random bytes in the new bundle so the bundle is exactly ``--mb`` MB (a bundle at the
default scene_max), and copies it: listing with sha256 on the node, chunks of 512 KiB four in flight,
private files, every sha256 checked. Timed: capture to MANIFEST.json written.

Baselines, the same bytes over the same loopback in the same run:

- ``ssh cat``: one SSH session (asyncssh both ends, the same ciphers as gridwatch's link) that writes the
  bundle's bytes raw on its channel: no framing, no base64, no checksum, nothing written;
- ``one chunk in flight``: the same copy with a window of 1 (what the pipelining buys).

    .venv/bin/python benchmarks/bench_scene_copy.py [--mb 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gridwatch.console.runtime.scene_copy import SceneKeeper  # noqa: E402
from gridwatch.console.runtime.scene_store import CopyState  # noqa: E402
from gridwatch.sshlink.client import Fleet, FleetOptions  # noqa: E402
from gridwatch.sshlink.hostlist import parse_endpoints  # noqa: E402
from gridwatch.sshlink.keys import init_keys  # noqa: E402
from gridwatch.wire import protocol as p  # noqa: E402

ALGS = ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com", "aes128-ctr"]

# A plain SSH server that answers any session with the bytes of the files named on its command line, raw.
CAT_SERVER = r"""
import asyncio, sys, asyncssh
ALGS = ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com", "aes128-ctr"]
async def serve(process):
    for path in sys.argv[4:]:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                process.stdout.write(block)
                await process.stdout.drain()
    process.exit(0)
async def main():
    port, host_key, clients = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    await asyncssh.create_server(lambda: asyncssh.SSHServer(), "127.0.0.1", port, server_host_keys=[host_key],
                                 authorized_client_keys=clients, process_factory=serve, encoding=None,
                                 encryption_algs=ALGS)
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait(cond, timeout: float, what: str) -> None:  # noqa: ANN001 - a condition
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _ssh_cat(port: int, key: Path, known: Path) -> tuple[float, int]:
    import asyncssh

    t0 = time.perf_counter()
    async with asyncssh.connect("127.0.0.1", port, username="bench", client_keys=[str(key)], known_hosts=str(known),
                                encryption_algs=ALGS, agent_path=None, config=None) as conn:
        proc = await conn.create_process("cat", encoding=None)
        got = 0
        while data := await proc.stdout.read(1 << 20):
            got += len(data)
    return time.perf_counter() - t0, got


async def _run(args: argparse.Namespace, work: Path) -> int:
    keys = init_keys(work / "keys", shared_host_key=True)
    port, scenes, total = _free_port(), work / "node-scenes", int(args.mb * 10**6)
    agent = subprocess.Popen(
        [sys.executable, "-m", "gridwatch", "agent", "--node-name", "node-1", "--listen", f"127.0.0.1:{port}",
         "--host-key", str(keys.host_key), "--authorized-viewers", str(keys.authorized_viewers),
         "--authorized-operators", str(keys.authorized_operators), "--simulate-gpus", "2", "--interval", "1",
         "--no-kernel-log", "--scene-dir", str(scenes)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    fleet = Fleet(parse_endpoints(f"127.0.0.1:{port}"),
                  FleetOptions(key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts)))
    cat = None
    try:
        await fleet.start()
        await _wait(lambda: fleet.connected == 1, 30, "the agent")

        async def read(node: str, read_args: dict, timeout: float) -> p.ActionResult:
            return await fleet.action(node, p.AgentAction.READ_SCENE, read_args, reason="bench", timeout=timeout)

        core = work / "core.bin"  # the same bytes in every bundle and through the baseline
        core.write_bytes(os.urandom(total))

        async def capture_and_copy(window: int, keep: bool = False) -> tuple[float, float, list[Path]]:
            t0 = time.perf_counter()
            captured = await fleet.action("node-1", "capture_scene", {"incident": "bench"}, reason="bench")
            if not captured.ok:
                raise RuntimeError(f"capture failed: {captured.message}")
            t_capture = time.perf_counter() - t0
            bundle = Path(str(captured.data["path"]))
            small = sum(f.stat().st_size for f in bundle.iterdir())
            with core.open("rb") as src, (bundle / "core.bin").open("wb") as dst:  # not timed: the bundle made 64 MB
                dst.write(src.read(total - small))
            keeper = SceneKeeper(work / "store", read, max_bytes=total, window=window)
            t1 = time.perf_counter()
            copy = await keeper.keep("node-1", "bench", str(bundle))
            t_copy = time.perf_counter() - t1
            if copy.state is not CopyState.WHOLE or copy.size != total:
                raise RuntimeError(f"the copy is not whole: {copy.line()}")
            files = sorted(bundle.iterdir())
            # A capture and a copy are two requests of the key's budget on the agent (2 a second by default):
            # paced, so no run is refused for the ones before it.
            await asyncio.sleep(1.1)
            if not keep and copy.where is not None:  # a disk's worth of bundles otherwise, over many runs
                shutil.rmtree(bundle)
                shutil.rmtree(copy.where)
            return t_capture, t_copy, files

        _, _, files = await capture_and_copy(4, keep=True)  # warm: the link, the page cache, the store's folders
        cat_port = _free_port()
        cat = subprocess.Popen([sys.executable, "-c", CAT_SERVER, str(cat_port), str(keys.host_key),
                                str(keys.authorized_operators), *map(str, files)], stdout=subprocess.PIPE, text=True)
        assert cat.stdout is not None
        if not cat.stdout.readline().startswith("ready"):
            raise RuntimeError("the ssh cat server did not start")
        piped, single, capture_s, raw = [], [], [], []
        # Interleaved, so that whatever else the machine does weighs on each the same.
        for _ in range(args.runs):
            t_capture, t_copy, _ = await capture_and_copy(4)
            capture_s.append(t_capture)
            piped.append(t_copy)
            single.append((await capture_and_copy(1))[1])
            seconds, got = await _ssh_cat(cat_port, keys.operator_key, keys.known_hosts)
            if got != total:
                raise RuntimeError(f"ssh cat moved {got} bytes, not {total}")
            raw.append(seconds)
    finally:
        await fleet.stop()
        for proc in (agent, cat):
            if proc is not None:
                proc.kill()
                proc.wait()

    med = statistics.median
    whole = [c + t for c, t in zip(capture_s, piped, strict=True)]
    mb = total / 1e6
    print(f"scene copy of a {mb:g} MB bundle on loopback, median of {args.runs} runs (agent process + console here)")
    print(f"  capture_scene (the agent writes its bundle)        {med(capture_s) * 1e3:8.1f} ms")
    print(f"  copy, 4 chunks in flight (sha256 checked, 0600)    {med(piped) * 1e3:8.1f} ms  {mb / med(piped):6.1f} MB/s")
    print(f"  capture to the whole bundle in the console's store {med(whole) * 1e3:8.1f} ms")
    print(f"  baseline: ssh cat of the same bytes (raw channel)  {med(raw) * 1e3:8.1f} ms  {mb / med(raw):6.1f} MB/s")
    print(f"  baseline: the same copy, one chunk in flight       {med(single) * 1e3:8.1f} ms  {mb / med(single):6.1f} MB/s")
    print(f"  ratio copy / ssh cat: {med(piped) / med(raw):.2f}x; one chunk in flight / four: "
          f"{med(single) / med(piped):.2f}x")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=64.0, help="the bundle's size in MB (default 64, scene_max's default)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gw-bench-scene-"))
    try:
        return asyncio.run(_run(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
