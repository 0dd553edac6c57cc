"""What the runtime's parts share: the fleet and executor it drives, its hooks, and its state as they read it.

:class:`gridwatch.console.runtime.core.ConsoleRuntime` sets that state in its constructor and puts the parts
together: frames in (``frames.py``), plans launched (``plans.py``), the loop closed (``recoveries.py``) and
actions out (``actions.py``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gridwatch.console.fleet.goodput_tracker import GoodputTracker
from gridwatch.console.fleet.state import StateStore
from gridwatch.console.runtime.collector import CollectorBaseline
from gridwatch.console.runtime.hangs import HangWatch
from gridwatch.console.runtime.incidents import IncidentActor, IncidentBackend, IncidentRow
from gridwatch.wire.protocol import ActionResult, Frame, LogLine

if TYPE_CHECKING:
    from gridwatch.console.runtime.leader import Election
    from gridwatch.console.runtime.recoveries import _Recovery
    from gridwatch.console.runtime.scene_copy import SceneKeeper
    from gridwatch.playbooks.engine import Engine
    from gridwatch.playbooks.plans import Plan


class FleetLike(Protocol):
    """The parts of ``gridwatch.sshlink.client.Fleet`` the console uses."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def action(self, node: str, action: str, args: dict | None = None, reason: str = "",
                     timeout: float = 30.0, fence: int | None = None, key: str | None = None) -> ActionResult: ...

    async def search(self, pattern: str, nodes: list[str] | None = None, since: float | None = None,
                     until: float | None = None, limit: int = 500,
                     on_progress: Callable[[int, int], None] | None = None) -> list[LogLine]: ...

    def subscribe_logs(self, node: str, on: bool) -> None: ...


class PlanRunner(Protocol):
    """The playbook executor (``gridwatch.playbooks.executor.Executor``)."""

    async def run(self, plan: Any) -> list[Any]: ...

    async def resume(self) -> list[str]: ...

    async def return_to_service(self, node: str, who: str, reason: str) -> str: ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class RuntimeHooks:
    """Who else hears what the runtime does (the demo's lines, a headless console's output); each call stays cheap."""

    plan: list[Callable[[Plan], None]] = field(default_factory=list)
    action: list[Callable[[str, str, ActionResult], None]] = field(default_factory=list)  # node, action, result
    frame: list[Callable[[Any, Frame], None]] = field(default_factory=list)  # link, frame
    link: list[Callable[[Any], None]] = field(default_factory=list)
    alert: list[Callable[[str | None], None]] = field(default_factory=list)
    relay: list[Callable[[Any], None]] = field(default_factory=list)  # a relay's link went up or down
    recovered: list[Callable[[IncidentRow], None]] = field(default_factory=list)
    resolved: list[Callable[[str], None]] = field(default_factory=list)  # incident id
    stopping: list[Callable[[], Awaitable[None]]] = field(default_factory=list)  # awaited as the runtime stops
    starting: list[Callable[[], Awaitable[None]]] = field(default_factory=list)  # awaited as the runtime starts


class RuntimeBase:
    """The runtime's state as its parts read it (``ConsoleRuntime.__init__`` sets all of it), and who may act."""

    store: StateStore
    fleet: FleetLike | None
    incidents: IncidentBackend | None
    actor: IncidentActor | None
    engine: Engine | None
    executor: PlanRunner | None
    plan_store: Any  # the incident store: plans, faults, recoveries and the audit log
    read_only_flag: bool
    operator: str
    acting: bool
    tick_interval: float
    action_timeout: float
    trainer_wait: float
    retry_every: float
    hooks: RuntimeHooks
    _plans: set[asyncio.Task[Any]]
    _ticker: asyncio.Task[None] | None
    _tried: set[str]
    _links_tried: asyncio.Event
    _up: set[str]
    relays_down: dict[str, str]
    collector: CollectorBaseline
    store_retry_every: float
    _store_retried: float
    _symptoms: deque[tuple[float, float, float]]
    _recoveries: dict[str, _Recovery]
    goodput: GoodputTracker
    election: Election | None
    hangs: HangWatch
    scenes: SceneKeeper | None

    def _all_tried(self) -> bool:
        links = getattr(self.fleet, "links", None)
        return not links or all(str(ep) in self._tried for ep in links)

    @property
    def read_only(self) -> bool:
        """Read-only when configured so, or when every agent heard from gave this console only the viewer role.

        Links not heard from yet decide nothing: right after a start no agent
        has said hello, and a console configured to act must still act then.
        """
        if self.read_only_flag:
            return True
        # Counted by the store as links and hellos change: the status bar asks on every tick.
        roles = self.store.role_counts()
        return bool(roles) and not roles.get("operator")
