"""Actions out: a playbook step or an operator's action to one node, and the operator's changes to incidents.

Each is checked first (read-only, the lead, a history rule that keeps a node out, a watch-only run) and audited.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec
from loguru import logger

from gridwatch.console.runtime.recoveries import Recovering
from gridwatch.playbooks.store import OPEN_STATES
from gridwatch.wire.protocol import ActionResult, AgentAction, ResultCode, Text

# Agent actions that change the job or the node; a watch-only runtime (a baseline run) does not send these.
ACTING_ACTIONS: frozenset[str] = frozenset(
    {AgentAction.ISOLATE, AgentAction.CHECKPOINT_NOW, AgentAction.PAUSE, AgentAction.RESTART_FROM, AgentAction.LEAVE}
)


class Acting(Recovering):
    """What is sent to the nodes, and what the operator changes of an incident."""

    async def act(self, node: str, action: str, args: dict[str, Any], reason: str) -> ActionResult:
        """The executor's action sink: a playbook step to one node, with the same read-only check as the operator's.

        A restart that finds the node's trainer between two lives (the job
        re-forming after a node left) is sent again until it answers or
        ``trainer_wait`` runs out.
        """
        args = self._with_checkpoint_step(action, args)
        if not self.acting and action in ACTING_ACTIONS:
            result = ActionResult(id=Text(""), action=Text(action), ok=False, node=Text(node),
                                  message=Text("not sent: playbooks only watch in this run"),
                                  code=Text(ResultCode.NOT_SENT))
        else:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.trainer_wait
            while True:
                result = await self._send(node, action, args, reason)
                if (result.ok or action != AgentAction.RESTART_FROM or result.code != ResultCode.TRAINER_ABSENT
                        or loop.time() >= deadline):
                    break
                await asyncio.sleep(self.retry_every)
            if result.ok and action == AgentAction.CAPTURE_SCENE and self.scenes is not None:
                # Before the plan's next step touches the node: the evidence must outlive it.
                result = await self._keep_scene(node, args, result)
        for hook in self.hooks.action:
            hook(node, action, result)
        return result

    async def _keep_scene(self, node: str, args: dict[str, Any], result: ActionResult) -> ActionResult:
        """The bundle just captured, copied into the console's scene store; the result and the audit say where."""
        assert self.scenes is not None
        from gridwatch.console.runtime.scene_copy import SceneCopy
        from gridwatch.console.runtime.scene_store import CopyState
        from gridwatch.playbooks.executor import STEP_KEY

        # An operator's capture outside any incident is kept under its own name, which `gridwatch scene` takes too.
        incident = str(args.get("incident") or time.strftime("operator-%Y%m%dT%H%M%SZ", time.gmtime()))
        on_node = str(result.data.get("path") or "")
        try:
            copy = await self.scenes.keep(node, incident, on_node)
        except Exception as exc:  # noqa: BLE001 - the console's disk: the plan goes on, the scene stays on the node
            logger.bind(node=node).exception("the scene of {} was not copied", incident)
            copy = SceneCopy(node, incident, on_node, CopyState.NOT_COPIED,
                             why=f"the console could not keep it: {type(exc).__name__}: {exc}")
        if self.plan_store is not None:
            try:
                self.plan_store.audit(self.operator, f"scene copy from {node}", f"evidence of {incident}",
                                      incident=incident if "incident" in args else None, step=STEP_KEY.get(),
                                      phase="after", outcome=f"{copy.line()} (on the node: {on_node or '-'})")
            except Exception:  # noqa: BLE001 - the copy is on disk either way; the log says why
                logger.bind(node=node).exception("cannot audit the scene copy of {}", incident)
        data = {**result.data, "console_copy": str(copy.where or ""), "copy_state": str(copy.state)}
        return msgspec.structs.replace(result, message=Text(f"{result.message}; console copy {copy.line()}"), data=data)

    async def read_scene(self, node: str, args: dict[str, Any], timeout: float) -> ActionResult:
        """One ``read_scene`` to ``node``: a read, so no fencing token nor step key goes with it."""
        if self.fleet is None:
            return _refused(node, AgentAction.READ_SCENE, "no fleet connected")
        return await self.fleet.action(node, AgentAction.READ_SCENE, args, reason="scene copy", timeout=timeout)

    def _with_checkpoint_step(self, action: str, args: dict[str, Any]) -> dict[str, Any]:
        """A restart the engine named no common checkpoint for gets the newest any trainer reports.

        Every node gets the same step (a node that just rejoined may still show
        its old process's checkpoints); the trainer falls back to its own rule
        when that step does not validate.
        """
        if action != AgentAction.RESTART_FROM or "step" in args:
            return args
        steps = sorted({s for n in self.store.nodes.values() if n.trainer is not None
                        for s in n.trainer.checkpoints.values()})
        if args.get("checkpoint") == "before" and args.get("before_step") is not None:
            steps = [s for s in steps if s < int(args["before_step"])]
        return {**args, "step": steps[-1]} if steps else args

    async def _send(self, node: str, action: str, args: dict[str, Any], reason: str) -> ActionResult:
        if self.read_only:
            return _refused(node, action, "this console is read-only")
        if self.fleet is None:
            return _refused(node, action, "no fleet connected")
        from gridwatch.playbooks.executor import STEP_KEY

        # With an election, the newest fencing token this console held and the step being run: the agent
        # checks both. A console alone sends neither, as before there were several.
        stamp: dict[str, Any] = {}
        if self.election is not None:
            stamp = {"fence": self.election.fence, "key": STEP_KEY.get()}
        try:
            return await self.fleet.action(node, action, args, reason=reason, timeout=self.action_timeout, **stamp)
        except Exception as exc:  # noqa: BLE001 - the operator sees why, the screen keeps going
            return _refused(node, action, f"{type(exc).__name__}: {exc}")

    async def node_action(self, node: str, action: str, reason: str, args: dict | None = None,
                          who: str | None = None, force: bool = False) -> ActionResult:
        """An operator's action on one node, audited before and after like a playbook step; refused when read-only.

        A node put back in service (``unisolate``) is handed back to the
        scheduler too, when the drain there is gridwatch's. A node a history
        rule keeps out (gridwatch.playbooks.history) is refused, in one line, unless
        ``force``; a forced return is audited with what it overrode.
        """
        who = who or self.operator
        if self.read_only:
            return _refused(node, action, "this console is read-only")
        if self.election is not None:
            from gridwatch.console.runtime.leader import observer_refusal

            observing = observer_refusal(self.election)
            if observing:
                return _refused(node, action, observing)
        refusal = getattr(self.plan_store, "return_refusal", None) if action == AgentAction.UNISOLATE else None
        kept_out = refusal(node) if refusal is not None else None
        if kept_out and not force:
            self.audit(who, f"{action} on {node}", reason, "operator", f"refused: {kept_out}")
            return _refused(node, action, kept_out)
        if kept_out:
            self.audit(who, f"force {action} on {node}", reason, "operator", f"overrides: {kept_out}")
        what = f"{action} on {node}" + (f" {msgspec.json.encode(args).decode()}" if args else "")
        logger.bind(node=node).info("action {} by {}: {}", action, who, reason)
        self.audit(who, what, reason, "before", "")
        args = dict(args or {})
        if action == AgentAction.CAPTURE_SCENE and "incident" not in args:
            open_here = self._open_incident_on(node)
            if open_here is not None:
                args["incident"] = open_here  # the operator's look at a node in trouble is that incident's evidence
        result = await self._send(node, action, args, reason)
        if result.ok and action == AgentAction.CAPTURE_SCENE and self.scenes is not None:
            # As for a plan's capture: the node may be rebooted or re-imaged next, and its disk with it.
            result = await self._keep_scene(node, args, result)
        self.audit(who, what, reason, "after", f"{'done' if result.ok else 'failed'}: {result.message}")
        if result.ok and action == AgentAction.UNISOLATE and self.executor is not None:
            try:
                told = await self.executor.return_to_service(node, who, reason)
            except Exception as exc:  # noqa: BLE001 - the node is back either way; the operator sees why
                logger.bind(node=node).exception("return to service of {} failed", node)
                told = f"the scheduler was not told: {type(exc).__name__}: {exc}"
            result = msgspec.structs.replace(result, message=Text(f"{result.message}; scheduler: {told}"))
        return result

    def _open_incident_on(self, node: str) -> str | None:
        """The newest incident still open on ``node``, if the incident database can say."""
        incidents = getattr(self.plan_store, "incidents", None)
        if incidents is None:
            return None
        try:
            open_here = [r for r in incidents(states=OPEN_STATES) if r.node == node]
        except Exception:  # noqa: BLE001 - the capture goes on; it is kept under the operator's own name
            logger.bind(node=node).exception("cannot read the open incidents of {}", node)
            return None
        return max(open_here, key=lambda r: r.detected_at).id if open_here else None

    def audit(self, who: str, what: str, why: str, phase: str, outcome: str) -> None:
        if self.plan_store is None:
            return
        try:
            self.plan_store.audit(who, what, why, phase=phase, outcome=outcome)
        except Exception:  # noqa: BLE001 - the action still goes; the log says why
            logger.exception("cannot audit {}", what)

    def resolve(self, incident_id: str, why: str, who: str | None = None) -> None:
        """Done with an incident: the store says so and the engine opens a new one for the next symptom."""
        self._check_changes("resolve")
        if self.engine is not None:
            self.engine.resolve(incident_id)
        if self.plan_store is not None:
            self.plan_store.resolve(incident_id, who or self.operator, why)
        for hook in self.hooks.resolved:
            hook(incident_id)

    def acknowledge(self, incident_id: str, why: str) -> None:
        self._check_changes("acknowledge")
        assert self.incidents is not None
        self.incidents.acknowledge(incident_id, self.operator, why)

    def silence(self, incident_id: str, seconds: float, why: str) -> None:
        self._check_changes("silence")
        assert self.incidents is not None
        self.incidents.silence(incident_id, self.store.clock.now() + seconds, self.operator, why)

    async def act_on_incident(self, incident_id: str, why: str) -> str:
        self._check_changes("act")
        if self.actor is None:
            return "no playbook executor is attached to this console"
        outcome = await self.actor.act(incident_id, self.operator, why)
        self.settle(incident_id)
        return outcome

    def _check_changes(self, what: str) -> None:
        if self.read_only:
            raise PermissionError(f"cannot {what}: this console is read-only")
        store = self.plan_store if what == "resolve" else self.incidents
        if store is None and what != "act":
            raise PermissionError(f"cannot {what}: no incident store is attached")


def _refused(node: str, action: str, message: str) -> ActionResult:
    return ActionResult(id=Text(uuid.uuid4().hex[:8]), action=Text(action), ok=False, message=Text(message),
                        node=Text(node))
