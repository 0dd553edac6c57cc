"""The console's own /metrics: a real runtime through a real incident, scraped by a real Prometheus; the dashboard answers.

Real agents on loopback SSH relaying trainer control sockets (the stand-in job of
``tests/support_loop.py``), the runtime built by ``build_runtime``, SQLite,
and Debian's prometheus scraping the runtime's /metrics; every panel of the
shipped Grafana dashboard is asked through it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gridwatch.console.runtime.config import ConfigError, parse_cluster
from gridwatch.console.runtime.metrics import serve_metrics
from gridwatch.console.runtime.wiring import RuntimeOptions, build_runtime
from tests.conftest import wait_until, wait_until_async
from tests.prometheus_server import Prometheus, PrometheusUnavailable, prometheus
from tests.support_grafana import LABEL_VALUES, regex_escape, substitute
from tests.support_loop import FakeJob, agents_beside, runtime_over, stop_beside

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "gridwatch-console.json"


def dashboard_queries() -> list[tuple[str, str]]:
    panels: list[dict[str, Any]] = json.loads(DASHBOARD.read_text())["panels"]
    return [(str(p["title"]), str(t["expr"])) for p in panels for t in p.get("targets", []) if t.get("expr")]


def grafana_all(prom: Prometheus) -> dict[str, str]:
    values: dict[str, str] = {}
    for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        match = LABEL_VALUES.fullmatch(str(variable.get("query", "")).strip())
        if variable.get("type") == "query" and match is not None:
            found = prom.label_values(match.group(2), match.group(1).strip())
            values[variable["name"]] = "(" + "|".join(regex_escape(v) for v in found) + ")"
    return values


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_the_dashboard_has_a_panel_for_each_thing_the_issue_names() -> None:
    exprs = " ".join(e for _t, e in dashboard_queries())
    for name in ("incidents_open", "actions_total", "goodput_ratio", "time_seconds", "time_ratio",
                 "time_to_detect_seconds_bucket", "time_to_recover_seconds_bucket", "mttd_seconds"):
        assert f"gridwatch_console_{name}" in exprs, name


def test_metrics_address_is_checked_in_cluster_toml_and_a_taken_port_is_one_sentence(tmp_path: Path) -> None:
    config = parse_cluster('nodes = "n1:22"\nmetrics = "127.0.0.1:9400"\n', str(tmp_path / "cluster.toml"))
    assert config.metrics == "127.0.0.1:9400"
    with pytest.raises(ConfigError, match="metrics: expected HOST:PORT"):
        parse_cluster('nodes = "n1:22"\nmetrics = "everywhere"\n', str(tmp_path / "cluster.toml"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot serve metrics on 127.0.0.1:{port}") as err:
            build_runtime(RuntimeOptions(endpoints=[], key_path="k", known_hosts="h", metrics=f"127.0.0.1:{port}"))
        assert "\n" not in str(err.value)
    finally:
        taken.close()


async def test_a_real_incident_shows_in_the_console_metrics_and_every_dashboard_panel_answers(keys, tmp_path) -> None:
    names = ["node-1", "node-2", "node-3"]
    job = FakeJob(tmp_path, names)
    agents = await agents_beside(keys, job)
    db = tmp_path / "incidents.db"
    runtime = runtime_over(agents, keys, db)
    metrics = serve_metrics(runtime, "127.0.0.1:0")
    store = runtime.plan_store

    async def trainers() -> None:
        # node-2's GPU falls off the bus; the others re-form without it, restore step 36 and train on.
        await job.left.wait()
        await asyncio.sleep(0.5)  # the re-formation itself
        job.step = 36
        for name in ("node-1", "node-3"):
            job.up(name)
        await wait_until(lambda: any(r.cmd == "restart_from" for n in ("node-1", "node-3") for r in job.servers[n].take()),
                         30, "the restart sent to the re-formed job")
        # The job back at step 36 as the console sees it, before it trains on: a rollback of four steps.
        await wait_until(lambda: runtime.job_step() == 36, 10, "the console to see the job back at step 36")
        while True:
            job.step += 1
            await asyncio.sleep(0.1)  # the stand-in job's pace once restarted

    sim: asyncio.Task | None = None
    try:
        await runtime.start()
        await wait_until(lambda: runtime.job_step() == 40 and len(runtime.engine.live_nodes()) == 3, 20,
                         "three nodes training at step 40")
        before = await asyncio.to_thread(scrape, metrics.port)
        assert 'gridwatch_console_incidents_open{severity="critical"} 0.0' in before
        assert 'gridwatch_console_goodput_ratio{window="run"}' in before
        sim = asyncio.create_task(trainers())
        agents[1].agent.event("xid", "GPU has fallen off the bus", severity="critical", gpu=0, code=79)
        await wait_until(lambda: any(i.playbook == "xid-hardware" for i in store.incidents()), 10, "the incident")
        (rec,) = [i for i in store.incidents() if i.playbook == "xid-hardware"]
        await wait_until(lambda: store.incident(rec.id).steps_lost is not None, 30, "the job to train past it")
        rec = store.incident(rec.id)
        # What it cost, kept in SQLite beside its times: steps 37..40 done twice, on the job's 6 GPUs.
        assert rec.steps_lost == 4 and rec.gpu_hours_lost is not None and rec.gpu_hours_lost > 0
        kept = sqlite3.connect(db).execute("SELECT steps_lost, gpu_hours_lost FROM incidents WHERE id=?",
                                           (rec.id,)).fetchone()
        assert kept == (4, rec.gpu_hours_lost)
        text = await asyncio.to_thread(scrape, metrics.port)
        assert 'gridwatch_console_incidents_open{severity="critical"} 1.0' in text
        # The same incident's phase, as the store has it: it acted, and the job trained past the fault.
        assert store.incident(rec.id).phase == "recovered"
        assert 'gridwatch_console_incidents{phase="recovered"} 1.0' in text
        assert 'gridwatch_console_incidents{phase="open"} 0.0' in text
        assert 'gridwatch_console_actions_total{action="isolate",outcome="ok"} 1.0' in text
        assert "gridwatch_console_time_to_recover_seconds_count 1.0" in text
        assert 'gridwatch_console_time_seconds{use="detection",window="run"}' in text
        try:
            server = prometheus(tmp_path / "prometheus", [f"127.0.0.1:{metrics.port}"])
            prom = server.__enter__()
        except PrometheusUnavailable as exc:
            pytest.skip(str(exc))
        try:
            await _check_dashboard(prom)
        finally:
            server.__exit__(None, None, None)
    finally:
        await stop_beside(runtime, agents, job, sim)


async def _check_dashboard(prom: Prometheus) -> None:
    async def scraped_twice() -> bool:
        # Two scrapes after the actions: increase() over them answers.
        series = await asyncio.to_thread(prom.query, "count_over_time(gridwatch_console_actions_total[1m])")
        return bool(series) and min(float(s["value"][1]) for s in series) >= 2

    await wait_until_async(scraped_twice, timeout=20, what="Prometheus to scrape the console twice")
    values = await asyncio.to_thread(grafana_all, prom)
    assert set(values) == {"instance"}
    for title, expr in dashboard_queries():
        query = substitute(expr, values)
        assert "$" not in query, query
        result = await asyncio.to_thread(prom.query, query)
        assert result, (title, query)
        for s in result:
            assert s["value"][1] not in ("NaN", "+Inf", "-Inf"), (title, query, s)


def test_a_bad_metrics_flag_is_one_line_and_exit_2_on_console_and_demo(tmp_path: Path) -> None:
    from tests.support_cli import run_cli

    for name in ("k", "h"):
        (tmp_path / name).write_text("")
    for argv in (["console", "--headless", "--nodes", "127.0.0.1:1", "--key", str(tmp_path / "k"),
                  "--known-hosts", str(tmp_path / "h"), "--db", str(tmp_path / "db"), "--metrics", "nowhere"],
                 ["demo", "--headless", "--metrics", "nowhere"]):
        proc = run_cli(*argv)
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)
        (line,) = proc.stderr.strip().splitlines()
        assert "--metrics: expected HOST:PORT" in line, line


def test_promtool_finds_nothing_wrong_with_the_console_metrics() -> None:
    import shutil
    import subprocess

    from gridwatch.console.runtime.metrics import ConsoleMetrics
    from gridwatch.wire.protocol import ActionResult, Text
    from tests.support_app import trained_runtime

    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    runtime = trained_runtime()
    metrics = ConsoleMetrics(runtime)
    for hook in runtime.hooks.action:
        hook("node01", "isolate", ActionResult(id=Text("a"), action=Text("isolate"), ok=True, node=Text("node01")))
    text = metrics.render()
    assert b'gridwatch_console_goodput_ratio{window="run"} 0.8' in text
    assert b'gridwatch_console_actions_total{action="isolate",outcome="ok"} 1.0' in text
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr.decode() + result.stdout.decode()
