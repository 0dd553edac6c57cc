"""`gridwatch console --prometheus URL`: the fleet read from a real Prometheus, scraping real agents or dcgm-exporter's own text."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gridwatch.agent.metrics import MetricsExporter
from gridwatch.console.fleet.metrics import Metric
from gridwatch.console.fleet.node import NodeStatus
from gridwatch.console.fleet.prometheus import (
    HistoryWindow,
    Panel,
    PanelState,
    PrometheusError,
    PrometheusFleet,
    PrometheusOptions,
    parse_answer,
)
from gridwatch.console.fleet.state import StateStore
from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
from gridwatch.playbooks.clock import ManualClock
from gridwatch.wire.protocol import Sample, Text
from tests.conftest import free_port, start_agent, stop_agent, wait_until_async
from tests.prometheus_server import Prometheus, PrometheusUnavailable, prometheus

DATA = Path(__file__).parent / "data" / "dcgm"


class _Static(http.server.BaseHTTPRequestHandler):
    """Answers every GET with the server's ``body`` (a recorded scrape), or waits ``delay`` first."""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        server = self.server
        if getattr(server, "delay", 0.0):
            server.release.wait(server.delay)  # type: ignore[attr-defined]
        body: bytes = server.body  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", getattr(server, "content_type", "text/plain; version=0.0.4"))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def static_server(body: bytes, delay: float = 0.0, content_type: str = "text/plain; version=0.0.4") -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Static)
    server.body, server.delay, server.content_type = body, delay, content_type  # type: ignore[attr-defined]
    server.release = threading.Event()  # type: ignore[attr-defined]
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.release.set()  # type: ignore[attr-defined]
        server.shutdown()
        server.server_close()


def console_on(url: str, clock: ManualClock | None = None, **options: object):  # noqa: ANN201 - a ConsoleRuntime
    """The runtime `gridwatch console --prometheus URL` builds (no agents listed), polled by hand."""
    runtime = build_runtime(RuntimeOptions(endpoints=[], key_path="", known_hosts="", prometheus=url,
                                           tick_interval=0), clock=clock)
    assert runtime.prometheus is not None and runtime.fleet is None
    for name, value in options.items():
        setattr(runtime.prometheus.options, name, value)
    return runtime


@contextmanager
def running_prometheus(tmp_path: Path, targets: list[str]) -> Iterator[Prometheus]:
    try:
        server = prometheus(tmp_path / "prometheus", targets)
        prom = server.__enter__()
    except PrometheusUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield prom
    finally:
        server.__exit__(None, None, None)


# ------------------------------------------------------------- real agents


async def test_fleet_from_prometheus_scraping_real_agents(keys, tmp_path: Path) -> None:
    agents, exporters = [], []
    try:
        for n in range(2):
            ra = await start_agent(keys, name=f"node-{n}", gpus=2, interval=0.2)
            ra.agent.metrics = exporter = MetricsExporter()  # what `--metrics-listen` sets up
            agents.append(ra)
            exporters.append(exporter)
        targets = [f"127.0.0.1:{e.start('127.0.0.1', 0)}" for e in exporters]
        with running_prometheus(tmp_path, targets) as prom:
            clock = ManualClock(time.time())
            runtime = console_on(prom.url, clock)
            fleet = runtime.prometheus
            store = runtime.store

            async def both_nodes() -> bool:
                await fleet.poll_once()
                return all((n := store.by_name(f"node-{i}")) is not None and n.sample is not None
                           and len(n.sample.gpus) == 2 for i in range(2))

            await wait_until_async(both_nodes, timeout=20, what="both agents' GPUs read from Prometheus")
            assert fleet.panels[Panel.GPUS].state in (PanelState.OK, PanelState.SLOW)
            rows = {r.name: r for r in store.node_rows()}
            assert set(rows) == {"node-0", "node-1"}
            for row in rows.values():
                assert row.status is NodeStatus.OK and row.gpus == 2
                assert row.util is not None and 40 <= row.util <= 100  # the simulated GPUs train
                assert row.temp_max is not None and row.power_w is not None and row.mem_pct is not None
            node = store.by_name("node-0")
            assert node is not None and node.hello is not None
            assert [g.index for g in node.hello.gpus] == [0, 1] and all(g.uuid for g in node.hello.gpus)
            # The heatmap draws from the same store: two nodes of two cells, every one known.
            cells = store.heatmap(Metric.UTIL)
            assert [len(c.values) for c in cells] == [2, 2]
            assert all(v is not None for c in cells for v in c.values)
            # The node view's past hour: query_range over the same series.
            history = await fleet.fetch_history("node-0", HistoryWindow.HOUR)
            assert history is not None and sorted(history.gpus) == [0, 1]
            assert any(v == v for v in history.gpus[0][0]), "no utilisation point in the past hour"
            await runtime.stop()
    finally:
        for exporter in exporters:
            exporter.close()
        for ra in agents:
            await stop_agent(ra)


async def test_gpu_temperature_playbook_fires_from_prometheus_data_alone(keys, tmp_path: Path) -> None:
    ra = await start_agent(keys, name="node-hot", gpus=2, interval=0.2)
    ra.agent.metrics = exporter = MetricsExporter()
    try:
        target = f"127.0.0.1:{exporter.start('127.0.0.1', 0)}"
        with running_prometheus(tmp_path, [target]) as prom:
            clock = ManualClock(time.time())
            runtime = console_on(prom.url, clock)
            fleet = runtime.prometheus
            ra.agent.gpus.inject("thermal", 1)  # GPU 1 runs at 91-95 C from now on

            async def hot() -> bool:
                await fleet.poll_once()
                node = runtime.store.by_name("node-hot")
                return bool(node and node.sample and (node.sample.gpus[1].temp_c or 0) > 90)

            await wait_until_async(hot, timeout=20, what="Prometheus to report GPU 1 above 90 C")
            assert not _incidents(runtime, "gpu-temperature")
            clock.advance(61)  # the playbook's "for 60s", on the console's clock
            await fleet.poll_once()
            found = _incidents(runtime, "gpu-temperature")
            assert [(r.node, r.state) for r in found] == [("node-hot", "open")], found
            assert "gpu 1" in found[0].title
            await runtime.stop()
    finally:
        exporter.close()
        await stop_agent(ra)


def _incidents(runtime, playbook: str) -> list:  # noqa: ANN001
    return [r for r in runtime.incidents.incidents() if r.playbook == playbook]


# ------------------------------------------------- dcgm-exporter's own text


async def test_a_site_with_only_dcgm_exporter_shows_its_nodes_and_gpus(tmp_path: Path) -> None:
    with static_server((DATA / "a800-mig-metrics.txt").read_bytes()) as a800, \
            static_server((DATA / "t4-metrics.txt").read_bytes()) as t4, \
            running_prometheus(tmp_path, [a800, t4]) as prom:
        runtime = console_on(prom.url)
        store = runtime.store

        async def scraped() -> bool:
            await runtime.prometheus.poll_once()
            return len(store.nodes) == 2

        await wait_until_async(scraped, timeout=20, what="both recorded scrapes read back from Prometheus")
        a800_node, t4_node = store.by_name("msxf-hpc-64-35-ai"), store.by_name("424773df46e0")
        assert a800_node is not None and a800_node.sample is not None
        gpus = a800_node.sample.gpus
        assert [g.index for g in gpus] == list(range(8))
        assert [g.temp_c for g in gpus] == [33, 27, 26, 31, 31, 26, 26, 29]
        # GPU 0 is split by MIG: dcgm-exporter gives it no utilisation, which is N/A, not 0.
        assert gpus[0].util is None and [g.util for g in gpus[1:]] == [0.0] * 7
        assert gpus[0].mem_total_mb == 19967 and gpus[1].mem_total_mb == 81228
        assert gpus[0].power_w == pytest.approx(78.174)
        assert a800_node.hello is not None and {str(g.name) for g in a800_node.hello.gpus} == {"NVIDIA A800-SXM4-80GB"}
        assert t4_node is not None and t4_node.sample is not None
        assert [(g.temp_c, g.power_w, g.mem_total_mb) for g in t4_node.sample.gpus] == [(25, 8.969, 15109)]
        rows = {r.name: r for r in store.node_rows()}
        assert rows["msxf-hpc-64-35-ai"].gpus == 8 and rows["424773df46e0"].gpus == 1
        assert rows["msxf-hpc-64-35-ai"].temp_max == 33
        await runtime.stop()


# ------------------------------------------------------------- bad input


async def test_down_garbage_and_slow_prometheus_are_panel_states_not_crashes() -> None:
    clock = ManualClock(1000.0)
    store = StateStore(clock)
    frames: list[object] = []
    down = PrometheusFleet(PrometheusOptions(f"http://127.0.0.1:{free_port()}", timeout=1.0), store,
                           lambda link, frame: frames.append(frame))
    await down.poll_once()
    status = down.panels[Panel.GPUS]
    assert status.state is PanelState.FAILING and "cannot be reached" in status.detail
    assert down.panels[Panel.HOSTS].state is PanelState.FAILING
    first_retry = status.retry_at
    assert first_retry is not None and first_retry > clock.now()
    await down.poll_once()  # inside the backoff: not asked again
    assert status.failures == 1
    clock.set(first_retry + 0.1)
    await down.poll_once()
    assert status.failures == 2 and status.retry_at is not None
    assert status.retry_at - clock.now() > first_retry - 1000.0  # backed off further
    assert "retry in" in status.line(clock.now()) and "no data yet" in status.line(clock.now())

    with static_server(b"<html>502 Bad Gateway</html>", content_type="text/html") as garbage:
        bad = PrometheusFleet(PrometheusOptions(f"http://{garbage}", timeout=2.0), store, lambda link, frame: None)
        await bad.poll_once()
        assert "not Prometheus's query API" in bad.panels[Panel.GPUS].detail

    with static_server(b'{"status":"success","data":{"resultType":"vector","result":[]}}', delay=5.0) as slow:
        sluggish = PrometheusFleet(PrometheusOptions(f"http://{slow}", timeout=0.5), store, lambda link, frame: None)
        began = time.monotonic()
        await sluggish.poll_once()
        assert time.monotonic() - began < 3.0, "a slow Prometheus held the poll past its timeout"
        assert "within 0.5 s" in sluggish.panels[Panel.GPUS].detail
    assert frames == [] and store.nodes == {}


def test_answers_that_are_not_the_query_api_are_one_sentence_each() -> None:
    cases = {
        b"": "not Prometheus's query API",
        b'{"status":"error","errorType":"bad_data","error":"parse error at char 3"}': "parse error at char 3",
        b'{"status":"success","data":{"resultType":"matrix","result":[]}}': "expected a vector",
        b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":"x"}]}}': "query API",
    }
    for body, said in cases.items():
        with pytest.raises(PrometheusError, match=said):
            parse_answer(body, "vector")
    # NaN and Inf are N/A; node text is cleaned like every node-supplied string.
    series = parse_answer(b'{"status":"success","data":{"resultType":"vector","result":['
                          b'{"metric":{"Hostname":"n\\u001b[31m1"},"value":[1,"NaN"]}]}}', "vector")
    assert series[0].last is None and series[0].labels["Hostname"] == "n[31m1"


async def test_a_down_prometheus_shows_per_panel_errors_and_the_ui_keeps_working() -> None:
    from gridwatch.console.tui.app import GridwatchApp
    from gridwatch.console.tui.screens import FleetScreen, NodeScreen

    runtime = console_on(f"http://127.0.0.1:{free_port()}", timeout=1.0, interval=0.2)
    store = runtime.store
    # One node known from before the outage: its row stays, its view opens.
    store.apply(Sample(node=Text("gpu-a"), ts=time.time()), "gpu-a")
    app = GridwatchApp(runtime, tick_seconds=0.1)
    async with app.run_test(size=(200, 50)) as pilot:
        screen = app.screen
        assert isinstance(screen, FleetScreen)

        def title() -> str:
            return str(app.screen.query_one("#view-title").render())

        deadline = time.monotonic() + 10
        while "cannot be reached" not in title():
            assert time.monotonic() < deadline, title()
            await pilot.pause(0.05)
        assert "gpus: Prometheus at" in title() and "hosts: Prometheus at" in title()
        await pilot.press("m", "s")  # the view still answers keys while Prometheus is down
        app.open_node("gpu-a")
        await pilot.pause(0.2)
        assert isinstance(app.screen, NodeScreen)
        await pilot.press("h")
        deadline = time.monotonic() + 10
        while "past 1h: history: Prometheus at" not in title():
            assert time.monotonic() < deadline, title()
            await pilot.pause(0.05)
        await pilot.press("escape")


async def test_node_exporter_beside_dcgm_exporter_fills_the_host(tmp_path: Path) -> None:
    # Both exporters on one host (127.0.0.1), different ports: node_exporter's series join the
    # dcgm node through the scrape target's host, as on a real GPU node.
    with static_server((DATA / "a800-mig-metrics.txt").read_bytes()) as a800, \
            static_server((DATA / "node-exporter-e2e-subset.txt").read_bytes()) as node_exporter, \
            running_prometheus(tmp_path, [a800, node_exporter]) as prom:
        runtime = console_on(prom.url)

        async def joined() -> bool:
            await runtime.prometheus.poll_once()
            node = runtime.store.by_name("msxf-hpc-64-35-ai")
            return bool(node and node.sample and node.sample.host.load1 is not None)

        await wait_until_async(joined, timeout=20, what="node_exporter's host values on the dcgm node")
        node = runtime.store.by_name("msxf-hpc-64-35-ai")
        assert node is not None and node.sample is not None
        host = node.sample.host
        assert (host.load1, host.load5, host.load15) == (0.21, 0.37, 0.39)
        assert host.mem_total_mb == pytest.approx(3.831959552e9 / 2**20)
        assert len(runtime.store.nodes) == 1  # node_exporter's target is no node of its own
        await runtime.stop()
