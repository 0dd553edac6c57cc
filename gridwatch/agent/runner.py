"""Start an agent from its config: open the sources once, serve until told to stop."""

from __future__ import annotations

import asyncio
import signal

from loguru import logger

from gridwatch.agent.agent import Agent
from gridwatch.agent.config import AgentConfig

# After SIGTERM, how long sessions and workers get to wind down before the agent exits anyway.
STOP_GRACE_S = 3.0


async def cancel_the_rest(timeout: float) -> list[str]:
    """Cancel every other task of this loop and wait up to ``timeout``; what is still running, described."""
    me = asyncio.current_task()
    rest = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for task in rest:
        task.cancel()
    if not rest:
        return []
    _, pending = await asyncio.wait(rest, timeout=timeout)
    return [f"{t.get_name()} {t.get_coro()!r}" for t in pending]


def build_agent(config: AgentConfig) -> Agent:
    """Open every source named by the config (each once) and wire them to an Agent."""
    from gridwatch.agent.logs import LogTailer
    from gridwatch.agent.sources.host import HostSource
    from gridwatch.agent.sources.ib.judge import IbThresholds
    from gridwatch.agent.sources.ib.source import open_ib_source
    from gridwatch.agent.sources.nvml import open_gpu_source
    from gridwatch.agent.stack import fingerprint

    gpus, notes = open_gpu_source(config.simulate_gpus, config.sim_seed)  # logs its notes once
    tailer = LogTailer(config.log, kernel=config.kernel_log, journal=config.journal, journal_cursor=config.journal_cursor,
                       kernel_files=config.kernel_logs)
    metrics = None
    if config.metrics_listen:
        from gridwatch.agent.metrics import MetricsExporter

        metrics = MetricsExporter()
    # HCA ports: simulated beside simulated GPUs, else whatever sysfs lists (none: no source).
    infiniband = open_ib_source(config.ib_root, config.simulate_gpus, config.sim_seed, IbThresholds(
        config.ib_error_rate, config.ib_flap_down_s, config.ib_flap_count, config.ib_flap_window_s))
    if metrics is not None and infiniband is not None:
        metrics.infiniband = infiniband
    trainer = None
    if config.trainer_socket:
        from gridwatch.agent.trainer_link import TrainerLink

        trainer = TrainerLink(config.trainer_socket, interval=config.interval)
    return Agent(
        config,
        gpus=gpus,
        host=HostSource(),
        tailer=tailer,
        metrics=metrics,
        trainer=trainer,
        infiniband=infiniband,
        stack=fingerprint(nvml=gpus is not None and not config.simulate_gpus),
        notes=notes,
    )


async def run_agent(config: AgentConfig, ready: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT; the bound port is logged (``--listen HOST:0`` picks one)."""
    from gridwatch.agent.server import serve

    agent = build_agent(config)
    host, port = config.listen_addr()
    acceptor = await serve(agent, host, port)
    bound = acceptor.sockets[0].getsockname()[1] if acceptor.sockets else port
    log = logger.bind(node=str(agent.node))
    log.info("agent {} listening on {}:{} (subsystem gridwatch)", agent.node, host, bound)
    metrics_addr = config.metrics_addr() if agent.metrics is not None else None
    if agent.metrics is not None and metrics_addr is not None:
        mhost, mport = metrics_addr
        agent.metrics.start(mhost, mport)
    if agent.trainer is not None:
        agent.trainer.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, agent.stop)
        except (NotImplementedError, RuntimeError):
            pass
    if config.patrol_interval > 0:
        # Imported only when on: the pre-flight checks behind it are most of a megabyte an agent without
        # patrol never needs.
        from gridwatch.agent.patrol import start_patrol

        agent.patrol = start_patrol(agent)
    if ready is not None:
        ready.set()
    try:
        await agent.run()
    finally:
        acceptor.close()
        if agent.trainer is not None:
            await agent.trainer.stop()
        agent.close_sources()
        stuck = await cancel_the_rest(STOP_GRACE_S)
        if stuck:
            log.warning("{} task(s) did not stop within {:g} s: {}", len(stuck), STOP_GRACE_S, "; ".join(stuck))
        log.info("agent stopped")
