"""dcgm-exporter's own Grafana dashboard (12239) against a real Prometheus scraping real agents: every panel answers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gridwatch.agent.metrics import MetricsExporter
from tests.conftest import start_agent, stop_agent, wait_until_async
from tests.prometheus_server import Prometheus, PrometheusUnavailable, prometheus
from tests.support_grafana import LABEL_VALUES, regex_escape, substitute

DASHBOARD = Path(__file__).parent / "data" / "dcgm" / "dcgm-exporter-dashboard.json"
NODES, GPUS = 2, 2


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, rows included."""
    panels: list[dict[str, Any]] = json.loads(DASHBOARD.read_text())["panels"]
    out = []
    for panel in panels + [p for row in panels for p in row.get("panels", [])]:
        out += [(str(panel.get("title")), str(t["expr"])) for t in panel.get("targets", []) if t.get("expr")]
    return out


def grafana_all(prom: Prometheus) -> dict[str, str]:
    """Each query variable of the dashboard set to "All", as Grafana sends it: ``(v1|v2|...)``."""
    values: dict[str, str] = {}
    for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        match = LABEL_VALUES.fullmatch(str(variable.get("query", "")).strip())
        if variable.get("type") != "query" or match is None:
            continue
        found = prom.label_values(match.group(2), match.group(1).strip())
        values[variable["name"]] = variable.get("allValue") or "(" + "|".join(regex_escape(v) for v in found) + ")"
    return values


def test_the_dashboard_copy_has_the_panels_the_issue_names() -> None:
    exprs = " ".join(expr for _title, expr in dashboard_queries())
    assert len(dashboard_queries()) >= 7
    assert "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" in exprs and "DCGM_FI_DEV_GPU_TEMP" in exprs


async def test_every_dashboard_query_answers_one_series_per_gpu(keys, tmp_path: Path) -> None:
    agents, exporters = [], []
    try:
        for n in range(NODES):
            ra = await start_agent(keys, name=f"node-{n}", gpus=GPUS, interval=0.2)
            exporter = MetricsExporter()
            ra.agent.metrics = exporter  # what `--metrics-listen` sets up in the runner
            agents.append(ra)
            exporters.append(exporter)
        targets = [f"127.0.0.1:{e.start('127.0.0.1', 0)}" for e in exporters]
        try:
            server = prometheus(tmp_path / "prometheus", targets)
            prom = server.__enter__()
        except PrometheusUnavailable as exc:
            pytest.skip(str(exc))
        try:
            await _check_dashboard(prom)
        finally:
            server.__exit__(None, None, None)
    finally:
        for exporter in exporters:
            exporter.close()
        for ra in agents:
            await stop_agent(ra)


async def _check_dashboard(prom: Prometheus) -> None:
    async def scraped() -> bool:
        series = await asyncio.to_thread(prom.query, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE")
        return len(series) == NODES * GPUS

    await wait_until_async(scraped, timeout=15, what="Prometheus to scrape every agent's GPUs")
    values = await asyncio.to_thread(grafana_all, prom)
    assert set(values) == {"instance", "gpu"}
    for title, expr in dashboard_queries():
        query = substitute(expr, values)
        assert "$" not in query, query
        result = await asyncio.to_thread(prom.query, query)
        if any("gpu" in s["metric"] for s in result):
            gpus = sorted((s["metric"]["instance"], s["metric"]["gpu"]) for s in result)
            assert len(gpus) == NODES * GPUS == len(set(gpus)), (title, query, gpus)
        else:  # an aggregate panel (avg, sum): one answer over every GPU
            assert len(result) == 1, (title, query, result)
        for s in result:
            assert s["value"][1] not in ("NaN", "+Inf", "-Inf"), (title, s)
