"""The receiver's CPU per small message over many SSH links: a stream read by a task against one read by callback,
with and without the empty SSH_MSG_IGNORE asyncssh puts before every packet.

One process serves ``--links`` asyncssh servers on loopback, each writing a ``--bytes`` line every
``--every`` seconds (staggered) on the gridwatch subsystem's kind of channel, with the cipher the console
asks for (aes128-gcm). Another process connects to all of them and counts lines, in one of two ways:
``stream`` (asyncssh's process streams, a task awaiting ``stdout.read()`` per link: the console's link
before) or ``callback`` (:class:`gridwatch.sshlink.stream.LineStream`: lines split and handed over in the
channel's own callback, the console's link now). The servers send the ignore before each packet
(``ignores``: asyncssh as it is) or not (``quiet``: :func:`gridwatch.sshlink.policy.quiet_ignores`, the
agent's and the relay's SSH face now). With ``--read-every 0.025,0.1`` the callback reader runs once more
per period on the loop that reads its sockets together at most that often (gridwatch.sshlink.coalesce: a
console's and a relay's 0.1 s, 25 ms before), against the quiet sender. Each is measured ``--runs`` times, interleaved:
the receiver's CPU over the window divided by the lines it received. Each period is measured twice more: with
asyncssh as it is, and ``+kept`` with the per-packet work gridwatch's links leave out (gridwatch.sshlink.fastpath:
AES-GCM kept per cipher, no packet log formatted below asyncssh's debug level 3), and once more ``lean``: the
packets read by libssh2 in C (gridwatch.sshlink.lean, the console's and the relay's agents' links now). Nothing
else of gridwatch runs: this is the transport's own cost, the floor under a console's per-message figure.

    .venv/bin/python benchmarks/bench_ssh_message.py [--links 500] [--every 1] [--seconds 15] [--runs 2]
        [--read-every 0.025,0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PORT0 = 24_000
KNOWN_HOSTS = Path(tempfile.gettempdir()) / f"bench_ssh_message.{os.getuid()}.known_hosts"


def serve(links: int, every: float, size: int, quiet: bool) -> None:
    import asyncssh

    from gridwatch.sshlink.policy import quiet_ignores

    line = b'{"v":1,"type":"summary","pad":"' + b"x" * max(size - 33, 0) + b'"}\n'

    class Server(asyncssh.SSHServer):
        def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
            if quiet:
                quiet_ignores(conn)

        def begin_auth(self, username: str) -> bool:
            return False  # loopback, a benchmark: no authentication

    async def session(process: asyncssh.SSHServerProcess) -> None:
        await asyncio.sleep((hash(process) % 1000) / 1000 * every)  # staggered, as agents' ticks are
        try:
            while True:
                process.stdout.write(line)
                await asyncio.sleep(every)
        except (OSError, asyncssh.Error):
            pass

    async def main() -> None:
        key = asyncssh.generate_private_key("ssh-ed25519")
        KNOWN_HOSTS.write_text(f"127.0.0.1 {key.export_public_key().decode()}")  # for the libssh2 reader
        for i in range(links):
            await asyncssh.create_server(Server, "127.0.0.1", PORT0 + i, server_host_keys=[key],
                                         process_factory=session, encoding=None)
        print("up", flush=True)
        await asyncio.Future()

    asyncio.run(main())


def receive(links: int, seconds: float, how: str) -> None:
    import asyncssh

    from gridwatch.sshlink.stream import LineStream

    if how.endswith("+kept"):  # asyncssh's per-packet path as gridwatch's links run it (gridwatch.sshlink.fastpath)
        from gridwatch.sshlink import fastpath

        fastpath.install()
        how = how.removesuffix("+kept")
    count = [0]
    client_key = asyncssh.generate_private_key("ssh-ed25519")  # the servers take anyone: no authentication

    async def one(i: int) -> None:
        if how.startswith("lean"):  # gridwatch.sshlink.lean: the packets read by libssh2, lines by LineStream
            from gridwatch.sshlink import lean
            from gridwatch.sshlink.hostlist import Endpoint

            _, stream = await lean.open_lean(Endpoint("127.0.0.1", PORT0 + i), {}, username="bench", key=client_key,
                                             known_hosts=str(KNOWN_HOSTS), subsystem="gridwatch")

            def counted(line: bytes) -> None:
                count[0] += 1

            stream.start(counted)
            await stream.closed
            return
        conn = await asyncssh.connect("127.0.0.1", PORT0 + i, known_hosts=None, username="bench", client_keys=None,
                                      encryption_algs=["aes128-gcm@openssh.com"], preferred_auth="none")
        if how == "stream":
            proc = await conn.create_process("gridwatch", encoding=None)
            while data := await proc.stdout.read(65536):
                count[0] += data.count(b"\n")
        else:
            _, stream = await conn.create_session(LineStream, "gridwatch", encoding=None)

            def on_line(line: bytes) -> None:
                count[0] += 1

            stream.start(on_line)
            await stream.closed

    async def main() -> None:
        tasks = []
        for i in range(links):
            tasks.append(asyncio.create_task(one(i)))
            if i % 50 == 49:
                await asyncio.sleep(0.05)
        await asyncio.sleep(5)  # every link up and settled
        c0, n0 = time.process_time(), count[0]
        await asyncio.sleep(seconds)
        cpu, n = time.process_time() - c0, count[0] - n0
        print(f"{n} {cpu}", flush=True)
        os._exit(0)

    if how.startswith(("callback@", "lean@")):
        from gridwatch.sshlink.coalesce import run_coalesced

        run_coalesced(main(), float(how.split("@")[1]))
    else:
        asyncio.run(main())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", type=int, default=500)
    ap.add_argument("--every", type=float, default=1.0)
    ap.add_argument("--bytes", type=int, default=760, help="a line's size (a summary is about 760)")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--read-every", default="", metavar="S,S",
                    help="periods (s) to read the sockets together at, each a callback reader of its own")
    ap.add_argument("--role", choices=("serve", "receive"), help=argparse.SUPPRESS)
    ap.add_argument("--how", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "serve":
        serve(args.links, args.every, args.bytes, args.how == "quiet")
        return 0
    if args.role == "receive":
        receive(args.links, args.seconds, args.how)
        return 0
    me = [sys.executable, __file__, "--links", str(args.links), "--every", str(args.every), "--bytes", str(args.bytes),
          "--seconds", str(args.seconds)]
    results: dict[tuple[str, str], list[float]] = {}
    print(f"{args.links} links, a {args.bytes}-byte line every {args.every:g} s each, {args.seconds:g} s windows, "
          f"load average {os.getloadavg()[0]:.1f}")
    for _ in range(args.runs):
        for sender in ("ignores", "quiet"):
            server = subprocess.Popen([*me, "--role", "serve", "--how", sender], stdout=subprocess.PIPE, text=True)
            try:
                assert server.stdout is not None and server.stdout.readline().strip() == "up"
                periods = [f"{reader}@{float(x):g}{kept}" for x in args.read_every.split(",") if x.strip()
                           for reader, kept in (("callback", ""), ("callback", "+kept"), ("lean", ""))]
                for how in ("stream", "callback", *(periods if sender == "quiet" else ())):
                    out = subprocess.run([*me, "--role", "receive", "--how", how], capture_output=True, text=True,
                                         timeout=args.seconds + 120, check=True).stdout.split()
                    lines, cpu = int(out[0]), float(out[1])
                    results.setdefault((how, sender), []).append(1e6 * cpu / max(lines, 1))
                    print(f"  {how:<8} reader, sender {sender:<7}: {lines:6d} lines, {1e6 * cpu / max(lines, 1):6.1f} µs "
                          "CPU per line", flush=True)
            finally:
                server.kill()
                server.wait()
    base = statistics.median(results[("stream", "ignores")])
    print("median µs per line (ratio against a task-read stream with the ignores, as before):")
    for (how, sender), values in results.items():
        m = statistics.median(values)
        print(f"  {how:<8} reader, sender {sender:<7}: {m:6.1f} µs  ({m / base:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
