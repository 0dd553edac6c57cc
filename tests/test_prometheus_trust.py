"""What a console believes of Prometheus: a node missing from an answer is unknown, not silent; a node only
Prometheus knows is never taken out; label values are node names only when an agent's name could be one.

Prometheus here is an HTTP stand-in serving its query API's answers (the shapes a relabel change, a down
exporter or a hostile label make), so each answer is exactly the case under test.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
from gridwatch.playbooks.clock import ManualClock
from tests.conftest import wait_until


class _Api(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = json.dumps({"status": "success", "data": {"resultType": "vector",
                                                          "result": self.server.series}}).encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def prometheus_api() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    server.series = []  # type: ignore[attr-defined]
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _series(node: str, metric: str = "DCGM_FI_DEV_GPU_TEMP", value: str = "55") -> dict:
    return {"metric": {"__name__": metric, "Hostname": node, "gpu": "0"}, "value": [1_700_000_000, value]}


def _console(server: http.server.ThreadingHTTPServer, clock: ManualClock):  # noqa: ANN202 - a ConsoleRuntime
    runtime = build_runtime(RuntimeOptions(endpoints=[], key_path="", known_hosts="", scheduler="slurm",
                                           prometheus=f"http://127.0.0.1:{server.server_address[1]}",
                                           tick_interval=0), clock=clock)
    assert runtime.prometheus is not None
    runtime.prometheus.options.interval = 5.0
    return runtime


async def test_a_node_missing_from_an_answer_is_unknown_and_reserved_or_bad_names_name_no_node() -> None:
    clock = ManualClock(1000.0)
    with prometheus_api() as server:
        server.series = [_series("node-a"), _series("node-b"), _series("ALL"), _series("node-c\nx"),  # type: ignore[attr-defined]
                         _series("node-d", value="1e308")]
        runtime = _console(server, clock)
        await runtime.prometheus.poll_once()
        assert sorted(n.name for n in runtime.store.nodes.values()) == ["node-a", "node-b", "node-d"]
        assert runtime.store.by_name("node-d").sample.gpus[0].temp_c is None  # 1e308 is no reading
        assert runtime.store.summary().hearsay == 3  # the footer says how the fleet is read
        server.series = [_series("node-a")]  # type: ignore[attr-defined]  # a relabel: node-b vanished
        for _ in range(12):  # a minute of answers without node-b
            clock.advance(5.0)
            await runtime.prometheus.poll_once()
            runtime.tick_engine()
        assert [i for i in runtime.engine.incidents() if i.kind == "heartbeat_lost"] == []
        await runtime.stop()


async def test_a_node_only_prometheus_knows_is_told_about_but_never_taken_out() -> None:
    clock = ManualClock(1000.0)
    with prometheus_api() as server:
        server.series = [_series("node-a"), _series("node-a", "DCGM_FI_DEV_XID_ERRORS", "0")]  # type: ignore[attr-defined]
        runtime = _console(server, clock)
        await runtime.prometheus.poll_once()
        server.series = [_series("node-a"), _series("node-a", "DCGM_FI_DEV_XID_ERRORS", "79")]  # type: ignore[attr-defined]
        await runtime.prometheus.poll_once()
        (incident,) = [i for i in runtime.engine.incidents() if i.playbook == "xid-hardware"]
        store = runtime.plan_store
        await wait_until(lambda: store.steps(incident.id), 5, "its plan recorded")
        steps = {s.step: s for s in store.steps(incident.id)}
        for name in ("capture_scene", "isolate_node", "drain_node"):
            assert steps[name].decision == "skip" and "known only from Prometheus" in steps[name].planned.reason
        assert steps["notify"].decision == "act"
        await wait_until(lambda: store.steps(incident.id)[-1].state == "done", 10, "the notify to go out")
        await runtime.stop()
