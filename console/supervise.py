"""Host the playbook engine and executor on a fleet without a screen: frames in, plans run, actions out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from loguru import logger

from agents.protocol import ActionResult, Frame
from playbooks.engine import Engine
from playbooks.executor import Executor
from playbooks.plans import Plan

ActionCallback = Callable[[str, str, ActionResult], None]
ArgsHook = Callable[[str, str, dict[str, Any]], dict[str, Any]]
PlanCallback = Callable[[Plan], None]
# Agent actions that change the job or the node; a watching-only sink refuses these.
ACTING_ACTIONS: frozenset[str] = frozenset({"isolate", "checkpoint_now", "pause", "restart_from", "leave"})
# How an agent says its node's trainer has no control socket right now (agents.trainer_link).
TRAINER_ABSENT = "no trainer is listening"


class Acting(Protocol):
    """What the sink needs from ``console.fleet.Fleet``."""

    async def action(self, node: str, action: str, args: dict[str, Any] | None = None, reason: str = "",
                     timeout: float = 30.0) -> ActionResult: ...


class FleetSink:
    """The executor's ActionSink over the fleet: each playbook step becomes an operator action on an agent."""

    def __init__(self, fleet: Acting, on_action: ActionCallback | None = None, timeout: float = 30.0,
                 args_hook: ArgsHook | None = None, acting: bool = True, trainer_wait: float = 30.0,
                 retry_every: float = 0.5) -> None:
        self.fleet = fleet
        self.on_action = on_action
        self.timeout = timeout
        self.args_hook = args_hook
        self.acting = acting
        self.trainer_wait = trainer_wait
        self.retry_every = retry_every

    async def act(self, node: str, action: str, args: dict[str, Any], reason: str) -> ActionResult:
        if self.args_hook is not None:
            args = self.args_hook(node, action, args)
        if not self.acting and action in ACTING_ACTIONS:
            # A baseline run: incidents are made and recorded, the job is left to itself.
            result = ActionResult(id="", action=action, ok=False, message="not sent: playbooks only watch in this run")
        else:
            result = await self._send(node, action, args, reason)
        if self.on_action is not None:
            self.on_action(node, action, result)
        return result


    async def _send(self, node: str, action: str, args: dict[str, Any], reason: str) -> ActionResult:
        """Send once; a restart that finds the node's trainer between two lives waits for the next one.

        A node leaving makes the others re-form: for a second or more no worker
        serves the control socket, and a restart sent then would fail although
        the job is about to train again.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.trainer_wait
        while True:
            result = await self.fleet.action(node, action, args, reason, timeout=self.timeout)
            if (result.ok or action != "restart_from" or TRAINER_ABSENT not in str(result.message)
                    or loop.time() >= deadline):
                return result
            await asyncio.sleep(self.retry_every)


class Supervisor:
    """Feeds every frame to the engine, ticks it, and runs each plan it makes in the background.

    ``feed(node, frame)`` is what ``ConsoleRuntime`` calls as its engine, so
    the Textual console and a headless run act the same way.
    """

    def __init__(self, engine: Engine, executor: Executor, *, on_plan: PlanCallback | None = None,
                 tick_interval: float = 0.5) -> None:
        self.engine = engine
        self.executor = executor
        self.on_plan = on_plan
        self.tick_interval = tick_interval
        self._running: set[asyncio.Task[Any]] = set()
        self._ticker: asyncio.Task[None] | None = None

    def feed(self, node: str, frame: Frame) -> None:
        self._launch(self.engine.observe(node, frame))

    def start(self) -> None:
        self._ticker = asyncio.create_task(self._tick_forever())

    async def _tick_forever(self) -> None:
        while True:
            try:
                self._launch(self.engine.tick())
            except Exception:  # noqa: BLE001 - a bad tick must not stop the watch
                logger.exception("playbook engine tick failed")
            await asyncio.sleep(self.tick_interval)

    def _launch(self, plans: list[Plan]) -> None:
        for plan in plans:
            if self.on_plan is not None:
                self.on_plan(plan)
            task = asyncio.create_task(self._run(plan))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, plan: Plan) -> None:
        try:
            await self.executor.run(plan)
        except Exception:  # noqa: BLE001 - one failed plan must not take the others down
            logger.bind(node=plan.incident.node).exception("plan for {} failed", plan.incident.id)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    async def stop(self, wait: float = 5.0) -> None:
        """Stop ticking; give running plans ``wait`` seconds to finish, then cancel them."""
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        if self._running:
            _, pending = await asyncio.wait(set(self._running), timeout=wait)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
