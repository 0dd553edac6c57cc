"""Validate playbook YAML against the schema, locating every error at ``file:line:column``.

PyYAML's composer gives nodes that carry their position; we walk those nodes
rather than the constructed Python values so each error points at the exact
key or value an operator has to fix, and we keep going to report them all.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gridwatch.playbooks.durations import parse_duration
from gridwatch.playbooks.metrics import parse_condition
from gridwatch.playbooks.model import (
    CONDITIONS,
    GPU_STEPS,
    SCHEDULERS,
    SCOPES,
    STEP_NAMES,
    WAIT_CONDITIONS,
    ConditionTrigger,
    EventTrigger,
    Guards,
    HistoryRule,
    HistoryRuleName,
    LogTrigger,
    MetricTrigger,
    Playbook,
    Step,
    Trigger,
)
from gridwatch.wire.protocol import EVENT_KINDS, SEVERITIES, STALE_AFTER_INTERVALS
from gridwatch.wire.xid import XidBlame, XidResolution


@dataclass(frozen=True)
class PlaybookError:
    """One thing wrong with a playbook file, where it is and what it is."""

    path: str
    line: int  # 1-based
    column: int  # 1-based
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}: {self.message}"


_PLAYBOOK_KEYS = ("name", "description", "severity", "scope", "trigger", "plan", "guards", "target", "settle", "dedup_window",
                  "replaces", "blame", "on_blame", "consequence_of")
# What ``blame:`` may name: the evidence that decides which node a hang incident acts on.
_BLAME_SOURCES: tuple[str, ...] = ("collectives",)
_TRIGGER_KEYS = ("event", "match", "count", "within", "distinct", "share", "metric", "for", "log", "source",
                 "condition", "missed")
_MATCH_KEYS = ("code", "severity", "message", "details", "resolution", "blame")
_RESOLUTIONS: tuple[str, ...] = tuple(r.value for r in XidResolution)
_BLAMES: tuple[str, ...] = tuple(b.value for b in XidBlame)
_STEP_KEYS = (
    "do", "confirm", "timeout", "continue_on_failure", "scheduler", "checkpoint",
    "channel", "url", "command", "message", "condition",
)
# Which options make sense on which step; anything else is a mistake worth naming.
_STEP_OPTIONS: dict[str, frozenset[str]] = {
    "drain_node": frozenset({"scheduler"}),
    "requeue_job": frozenset({"scheduler"}),
    "restart_from_checkpoint": frozenset({"checkpoint"}),
    "notify": frozenset({"channel", "url", "command", "message"}),
    "escalate": frozenset({"channel", "url", "command", "message"}),
    "wait_for": frozenset({"condition"}),
}
_COMMON_STEP_KEYS = frozenset({"do", "confirm", "timeout", "continue_on_failure"})
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


class _Checker:
    def __init__(self, path: str) -> None:
        self.path = path
        self.errors: list[PlaybookError] = []
        self._constructor = SafeConstructor()

    def error(self, node: Node, message: str) -> None:
        mark = node.start_mark
        self.errors.append(PlaybookError(self.path, mark.line + 1, mark.column + 1, message))

    def value(self, node: Node) -> Any:
        return self._constructor.construct_object(node, deep=True)

    def mapping(self, node: Node, allowed: tuple[str, ...], what: str) -> dict[str, tuple[Node, Node]]:
        """The keys of a mapping node, each with its key node and value node; names what is unknown."""
        if not isinstance(node, MappingNode):
            self.error(node, f"{what} must be a mapping of keys to values")
            return {}
        found: dict[str, tuple[Node, Node]] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, ScalarNode) else None
            if not isinstance(key, str):
                self.error(key_node, f"{what}: keys must be plain names")
                continue
            if key in found:
                self.error(key_node, f"{what}: duplicate key {key!r} (the earlier one would be silently lost)")
                continue
            if key not in allowed:
                self.error(key_node, f"{what}: unknown key {key!r}{_suggest(key, allowed)}")
                continue
            found[key] = (key_node, value_node)
        return found

    def scalar(self, node: Node, kind: type | tuple[type, ...], what: str) -> Any:
        if not isinstance(node, ScalarNode):
            self.error(node, f"{what} must be a single value, not a {'list' if isinstance(node, SequenceNode) else 'mapping'}")
            return None
        value = self.value(node)
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            self.error(node, f"{what} must be {_kind_name(kind)}, not true/false")
            return None
        if not isinstance(value, kind):
            self.error(node, f"{what} must be {_kind_name(kind)}, got {value!r}")
            return None
        return value

    def choice(self, node: Node, choices: tuple[str, ...], what: str) -> str | None:
        value = self.scalar(node, str, what)
        if value is None:
            return None
        if value not in choices:
            self.error(node, f"{what} must be one of {', '.join(choices)}; got {value!r}{_suggest(value, choices)}")
            return None
        return value

    def duration(self, node: Node, what: str) -> float | None:
        value = self.scalar(node, (str, int, float), what)
        if value is None:
            return None
        try:
            return parse_duration(value)
        except ValueError as exc:
            self.error(node, f"{what}: {exc}")
            return None

    def regex(self, node: Node, what: str) -> re.Pattern[str] | None:
        value = self.scalar(node, str, what)
        if value is None:
            return None
        try:
            return re.compile(value)
        except re.error as exc:
            self.error(node, f"{what}: not a valid regular expression ({exc})")
            return None

    def items(self, node: Node, what: str, parse: Callable[[Node], Any]) -> list[Any]:
        """A value written either once or as a list of values."""
        nodes = node.value if isinstance(node, SequenceNode) else [node]
        if isinstance(node, SequenceNode) and not nodes:
            self.error(node, f"{what} must not be an empty list")
        return [v for v in (parse(n) for n in nodes) if v is not None]

    def positive_int(self, node: Node, what: str) -> int | None:
        value = self.scalar(node, int, what)
        if value is not None and value < 1:
            self.error(node, f"{what} must be at least 1")
            return None
        return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {str: "text", int: "a whole number", float: "a number", bool: "true or false"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _suggest(word: str, choices: tuple[str, ...] | frozenset[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ------------------------------------------------------------------ the sections


def _trigger(c: _Checker, node: Node) -> Trigger | None:
    keys = c.mapping(node, _TRIGGER_KEYS, "trigger")
    if not keys and isinstance(node, MappingNode) and not node.value:
        c.error(node, "trigger is empty: give one of event, metric, log or condition")
        return None
    heads = [k for k in ("event", "metric", "log", "condition") if k in keys]
    if len(heads) != 1:
        if keys:
            c.error(node, "trigger needs exactly one of event, metric, log or condition"
                    + (f"; found {', '.join(heads)}" if heads else ""))
        return None
    head = heads[0]
    allowed = {
        "event": {"event", "match", "count", "within", "distinct", "share", "for"},
        "metric": {"metric", "for"},
        "log": {"log", "source", "count", "within"},
        "condition": {"condition", "missed"},
    }[head]
    for key, (key_node, _) in keys.items():
        if key not in allowed:
            c.error(key_node, f"trigger: {key!r} does not apply to a {head} trigger")
    count, within = 1, 0.0
    if "count" in keys:
        count = c.positive_int(keys["count"][1], "trigger.count") or 1
    if "within" in keys:
        within = c.duration(keys["within"][1], "trigger.within") or 0.0
    if count > 1 and not within and ("count" in keys):
        c.error(keys["count"][1], "trigger.count above 1 needs 'within' (how long to count over)")

    if head == "event":
        kinds = c.items(keys["event"][1], "trigger.event", lambda n: _event_kind(c, n))
        persistence = _persistence(c, keys, within)
        codes: list[int] = []
        severities: list[str] = []
        resolutions: list[str] = []
        blames: list[str] = []
        message = None
        details: list[tuple[str, re.Pattern[str]]] = []
        if "match" in keys:
            match = c.mapping(keys["match"][1], _MATCH_KEYS, "trigger.match")
            if "code" in match:
                codes = c.items(match["code"][1], "trigger.match.code", lambda n: c.scalar(n, int, "an XID code"))
            if "severity" in match:
                severities = c.items(match["severity"][1], "trigger.match.severity",
                                     lambda n: c.choice(n, SEVERITIES, "a severity"))
            if "resolution" in match:
                resolutions = c.items(match["resolution"][1], "trigger.match.resolution",
                                      lambda n: c.choice(n, _RESOLUTIONS, "an XID resolution"))
            if "blame" in match:
                blames = c.items(match["blame"][1], "trigger.match.blame", lambda n: c.choice(n, _BLAMES, "a blame"))
            if "message" in match:
                message = c.regex(match["message"][1], "trigger.match.message")
            if "details" in match:
                for key, (_, vnode) in _free_mapping(c, match["details"][1], "trigger.match.details").items():
                    pattern = c.regex(vnode, f"trigger.match.details.{key}")
                    if pattern is not None:
                        details.append((key, pattern))
        if not kinds:
            return None
        return EventTrigger(frozenset(kinds), frozenset(codes), frozenset(severities), message,
                            tuple(details), count, within, *persistence,
                            resolutions=frozenset(resolutions), blames=frozenset(blames))
    if head == "metric":
        text = c.scalar(keys["metric"][1], str, "trigger.metric")
        hold = c.duration(keys["for"][1], "trigger.for") if "for" in keys else None
        if text is None:
            return None
        try:
            return MetricTrigger(parse_condition(text, hold))
        except ValueError as exc:
            c.error(keys["metric"][1], f"trigger.metric: {exc}")
            return None
    if head == "log":
        pattern = c.regex(keys["log"][1], "trigger.log")
        source = c.regex(keys["source"][1], "trigger.source") if "source" in keys else None
        return LogTrigger(pattern, source, count, within) if pattern is not None else None
    condition = c.choice(keys["condition"][1], CONDITIONS, "trigger.condition")
    missed = STALE_AFTER_INTERVALS
    if "missed" in keys:
        value = c.scalar(keys["missed"][1], (int, float), "trigger.missed")
        if value is not None and value <= 1:
            c.error(keys["missed"][1], "trigger.missed must be more than 1 interval, or a slow tick looks like a dead node")
        elif value is not None:
            missed = float(value)
    if condition == "stack_mismatch" and "missed" in keys:
        c.error(keys["missed"][0], "trigger.missed applies only to heartbeat_lost")
    return ConditionTrigger(condition, missed) if condition else None


def _persistence(c: _Checker, keys: dict[str, tuple[Node, Node]], within: float) -> tuple[str | None, float, float | None]:
    """An event trigger's ``distinct``, ``for`` and ``share``: what makes repeated reports persistent."""
    distinct = c.scalar(keys["distinct"][1], str, "trigger.distinct") if "distinct" in keys else None
    hold = (c.duration(keys["for"][1], "trigger.for") or 0.0) if "for" in keys else 0.0
    share = None
    if "share" in keys:
        share = c.scalar(keys["share"][1], (int, float), "trigger.share")
        if share is not None and not 0 < share <= 1:
            c.error(keys["share"][1], "trigger.share must be above 0 and at most 1")
            share = None
        elif share is not None and distinct is None:
            c.error(keys["share"][0], "trigger.share needs 'distinct' naming a numbered detail (e.g. step)")
    if hold and "within" in keys and hold > within:
        c.error(keys["for"][1], "trigger.for is longer than 'within': the reports could never span it")
    if (hold or "distinct" in keys) and "count" not in keys:
        c.error(keys["for" if hold else "distinct"][0], "trigger: 'for' and 'distinct' need 'count' and 'within'")
    return distinct, hold, float(share) if share is not None else None


def _event_kind(c: _Checker, node: Node) -> str | None:
    kind = c.scalar(node, str, "trigger.event")
    if kind is not None and kind not in EVENT_KINDS:
        c.error(node, f"unknown event kind {kind!r}{_suggest(kind, EVENT_KINDS)}")
        return None
    return kind


def _free_mapping(c: _Checker, node: Node, what: str) -> dict[str, tuple[Node, Node]]:
    if not isinstance(node, MappingNode):
        c.error(node, f"{what} must be a mapping")
        return {}
    return {str(k.value): (k, v) for k, v in node.value}


def _step(c: _Checker, node: Node, index: int) -> Step | None:
    what = f"plan step {index + 1}"
    if isinstance(node, ScalarNode):
        name = c.choice(node, STEP_NAMES, what)
        if name in ("wait_for",):
            c.error(node, f"{what}: wait_for needs a condition; write it as a mapping with 'do' and 'condition'")
            return None
        return Step(name, line=node.start_mark.line + 1) if name else None
    keys = c.mapping(node, _STEP_KEYS, what)
    if "do" not in keys:
        if isinstance(node, MappingNode):
            c.error(node, f"{what}: needs 'do: <step>' naming one of {', '.join(STEP_NAMES)}")
        return None
    name = c.choice(keys["do"][1], STEP_NAMES, f"{what} 'do'")
    if name is None:
        return None
    options = _STEP_OPTIONS.get(name, frozenset())
    for key, (key_node, _) in keys.items():
        if key not in _COMMON_STEP_KEYS and key not in options:
            c.error(key_node, f"{what}: {key!r} does not apply to {name}")
    fields: dict[str, Any] = {"line": node.start_mark.line + 1}
    if "confirm" in keys:
        fields["confirm"] = bool(c.scalar(keys["confirm"][1], bool, f"{what} confirm"))
    if "continue_on_failure" in keys:
        fields["continue_on_failure"] = bool(c.scalar(keys["continue_on_failure"][1], bool, f"{what} continue_on_failure"))
    if "timeout" in keys:
        timeout = c.duration(keys["timeout"][1], f"{what} timeout")
        if timeout is not None and timeout <= 0:
            c.error(keys["timeout"][1], f"{what} timeout must be more than zero")
        elif timeout is not None:
            fields["timeout"] = timeout
    if "scheduler" in keys:
        fields["scheduler"] = c.choice(keys["scheduler"][1], SCHEDULERS, f"{what} scheduler")
    if "checkpoint" in keys:
        fields["checkpoint"] = c.choice(keys["checkpoint"][1], ("newest", "before"), f"{what} checkpoint") or "newest"
    if "channel" in keys:
        fields["channel"] = c.choice(keys["channel"][1], ("console", "webhook", "command"), f"{what} channel") or "console"
    if "url" in keys:
        url = c.scalar(keys["url"][1], str, f"{what} url")
        if url is not None and not url.startswith(("http://", "https://")):
            c.error(keys["url"][1], f"{what} url must start with http:// or https://")
        fields["url"] = url
    if "command" in keys:
        cnode = keys["command"][1]
        if not isinstance(cnode, SequenceNode) or not cnode.value:
            c.error(cnode, f"{what} command must be a non-empty list of arguments (it is never run through a shell)")
        else:
            fields["command"] = tuple(str(a) for a in (c.scalar(n, (str, int, float), "a command argument") for n in cnode.value) if a is not None)
    if "message" in keys:
        fields["message"] = c.scalar(keys["message"][1], str, f"{what} message") or ""
    if "condition" in keys:
        fields["condition"] = c.choice(keys["condition"][1], WAIT_CONDITIONS, f"{what} condition")
    channel = fields.get("channel", "console")
    if channel == "webhook" and not fields.get("url"):
        c.error(node, f"{what}: channel webhook needs a url")
    if channel == "command" and not fields.get("command"):
        c.error(node, f"{what}: channel command needs a command (a list of arguments)")
    if name == "wait_for" and not fields.get("condition"):
        if "condition" not in keys:
            c.error(node, f"{what}: wait_for needs a condition: one of {', '.join(WAIT_CONDITIONS)}")
        return None
    return Step(name, **fields)


def _guards(c: _Checker, node: Node) -> Guards:
    keys = c.mapping(node, ("cooldown", "blast_radius", "rate_limit", "repeat", "history"), "guards")
    fields: dict[str, Any] = {}
    if "history" in keys:
        fields["history"] = _history(c, keys["history"][1])
    if "cooldown" in keys:
        fields["cooldown"] = c.duration(keys["cooldown"][1], "guards.cooldown") or 0.0
    if "blast_radius" in keys:
        blast = c.mapping(keys["blast_radius"][1], ("max_nodes", "max_fraction", "window"), "guards.blast_radius")
        if "max_nodes" in blast:
            fields["blast_max_nodes"] = c.positive_int(blast["max_nodes"][1], "guards.blast_radius.max_nodes")
        if "max_fraction" in blast:
            frac = c.scalar(blast["max_fraction"][1], (int, float), "guards.blast_radius.max_fraction")
            if frac is not None and not 0 < frac <= 1:
                c.error(blast["max_fraction"][1], "guards.blast_radius.max_fraction must be above 0 and at most 1")
            elif frac is not None:
                fields["blast_max_fraction"] = float(frac)
        if "window" in blast:
            fields["blast_window"] = c.duration(blast["window"][1], "guards.blast_radius.window") or 3600.0
        if isinstance(keys["blast_radius"][1], MappingNode) and not ({"max_nodes", "max_fraction"} & set(blast)):
            c.error(keys["blast_radius"][1], "guards.blast_radius needs max_nodes or max_fraction")
    for key, prefix in (("rate_limit", "rate"), ("repeat", "repeat")):
        if key in keys:
            sub = c.mapping(keys[key][1], ("max", "window") + (("times", "after", "then") if key == "repeat" else ()),
                            f"guards.{key}")
            if key == "repeat" and ("after" in sub or "then" in sub):
                _repeat_after(c, sub, fields)
            elif "times" in sub:
                c.error(sub["times"][0], "guards.repeat.times goes with 'after' (the step that did not fix it)")
            if "max" in sub:
                fields[f"{prefix}_max"] = c.positive_int(sub["max"][1], f"guards.{key}.max")
            elif isinstance(keys[key][1], MappingNode) and not (key == "repeat" and "after" in sub):
                c.error(keys[key][1], f"guards.{key} needs max")
            if "window" in sub:
                window = c.duration(sub["window"][1], f"guards.{key}.window")
                if window:
                    fields[f"{prefix}_window"] = window
    return Guards(**fields)


# What the repeat rule plans when the same XID came back after its fix: the GPU needs a person.
INSPECTION_PLAN: tuple[Step, ...] = (
    Step("capture_scene"), Step("isolate_node"), Step("drain_node"), Step("requeue_job"),
    Step("restart_from_checkpoint"),
    Step("notify", message="hardware inspection: the same fault came back after the fix; node isolated and drained"),
)


def _repeat_after(c: _Checker, sub: dict[str, tuple[Node, Node]], fields: dict[str, Any]) -> None:
    """``repeat: {after: STEP, times: N, window: W, then: [steps]}`` (times 2 and the inspection plan by default)."""
    if "after" not in sub:
        c.error(sub["then"][0], "guards.repeat.then needs 'after' (the step whose repeats it follows)")
        return
    after = c.choice(sub["after"][1], STEP_NAMES, "guards.repeat.after")
    fields["repeat_after"] = after
    times = c.positive_int(sub["times"][1], "guards.repeat.times") if "times" in sub else 2
    if "max" in sub:
        c.error(sub["max"][0], "guards.repeat: with 'after', say how many times with 'times'")
    fields["repeat_max"] = times or 2
    then: tuple[Step, ...] = INSPECTION_PLAN
    if "then" in sub:
        tnode = sub["then"][1]
        if not isinstance(tnode, SequenceNode) or not tnode.value:
            c.error(tnode, "guards.repeat.then must be a non-empty list of steps")
        else:
            then = tuple(s for s in (_step(c, n, i) for i, n in enumerate(tnode.value)) if s is not None)
    fields["repeat_then"] = then


# Each history rule's defaults: (times, window).
_HISTORY_DEFAULTS: dict[HistoryRuleName, tuple[int, float]] = {
    HistoryRuleName.SAME_GPU: (2, 7 * 86400.0),
    HistoryRuleName.SAME_XID: (2, 86400.0),
    HistoryRuleName.REMEDIATIONS: (3, 7 * 86400.0),
}


def _history(c: _Checker, node: Node) -> tuple[HistoryRule, ...]:
    """``history: {same_gpu: {times, window, shadow, then}, same_xid: {...}, remediations: {...}}``."""
    names = tuple(r.value for r in HistoryRuleName)
    rules: list[HistoryRule] = []
    for name, (_, value) in c.mapping(node, names, "guards.history").items():
        what = f"guards.history.{name}"
        allowed = ("times", "window", "shadow") + (("then",) if name == HistoryRuleName.SAME_GPU else ())
        sub = c.mapping(value, allowed, what) if not (isinstance(value, ScalarNode) and value.value == "") else {}
        rule = HistoryRuleName(name)
        times, window = _HISTORY_DEFAULTS[rule]
        if "times" in sub:
            times = c.positive_int(sub["times"][1], f"{what}.times") or times
        if "window" in sub:
            window = c.duration(sub["window"][1], f"{what}.window") or window
        shadow = bool(c.scalar(sub["shadow"][1], bool, f"{what}.shadow")) if "shadow" in sub else False
        then: tuple[Step, ...] = INSPECTION_PLAN if rule == HistoryRuleName.SAME_GPU else ()
        if "then" in sub:
            tnode = sub["then"][1]
            if not isinstance(tnode, SequenceNode) or not tnode.value:
                c.error(tnode, f"{what}.then must be a non-empty list of steps")
            else:
                then = tuple(s for s in (_step(c, n, i) for i, n in enumerate(tnode.value)) if s is not None)
        rules.append(HistoryRule(rule, times, window, shadow, then))
    return tuple(rules)


def _playbook(c: _Checker, node: Node) -> Playbook | None:
    before = len(c.errors)
    keys = c.mapping(node, _PLAYBOOK_KEYS, "playbook")
    if not isinstance(node, MappingNode):
        return None
    for required in ("name", "trigger", "plan"):
        if required not in keys:
            c.error(node, f"playbook is missing {required!r}")
    name = c.scalar(keys["name"][1], str, "name") if "name" in keys else None
    if name is not None and not _NAME.match(name):
        c.error(keys["name"][1], f"name {name!r} must be lowercase letters, digits, '-' or '_'")
    fields: dict[str, Any] = {}
    if "description" in keys:
        fields["description"] = c.scalar(keys["description"][1], str, "description") or ""
    if "severity" in keys:
        fields["severity"] = c.choice(keys["severity"][1], SEVERITIES, "severity") or "warning"
    if "scope" in keys:
        fields["scope"] = c.choice(keys["scope"][1], SCOPES, "scope") or "node"
    if "target" in keys:
        target = c.scalar(keys["target"][1], str, "target")
        if target is not None and target not in ("self", "cause") and not target.startswith("detail:"):
            c.error(keys["target"][1], f"target must be self, cause or detail:<key>; got {target!r}")
        elif target is not None:
            fields["target"] = target
    if "settle" in keys:
        fields["settle"] = c.duration(keys["settle"][1], "settle") or 0.0
    if "dedup_window" in keys:
        fields["dedup_window"] = c.duration(keys["dedup_window"][1], "dedup_window") or 600.0
    if "replaces" in keys:
        # Whether it names a shipped playbook is checked where the two sets meet (gridwatch.playbooks.loader).
        replaces = c.scalar(keys["replaces"][1], str, "replaces")
        if replaces is not None and not _NAME.match(replaces):
            c.error(keys["replaces"][1], f"replaces {replaces!r} must be a playbook name")
        elif replaces is not None:
            fields["replaces"] = replaces
    if "consequence_of" in keys:
        fields.update(_consequence_of(c, keys["consequence_of"][1]))
    trigger = _trigger(c, keys["trigger"][1]) if "trigger" in keys else None
    steps: list[Step] = []
    if "plan" in keys:
        plan_node = keys["plan"][1]
        if not isinstance(plan_node, SequenceNode) or not plan_node.value:
            c.error(plan_node, "plan must be a non-empty list of steps")
        else:
            steps = [s for s in (_step(c, n, i) for i, n in enumerate(plan_node.value)) if s is not None]
    if "guards" in keys:
        fields["guards"] = _guards(c, keys["guards"][1])
    if "blame" in keys:
        fields["blame"] = c.choice(keys["blame"][1], _BLAME_SOURCES, "blame") is not None
    if "on_blame" in keys:
        blame_node = keys["on_blame"][1]
        if not fields.get("blame"):
            c.error(keys["on_blame"][0], "on_blame is the plan when the collective records blame a node; "
                                         "it needs blame: collectives")
        if not isinstance(blame_node, SequenceNode) or not blame_node.value:
            c.error(blame_node, "on_blame must be a non-empty list of steps")
        else:
            fields["blame_plan"] = tuple(s for s in (_step(c, n, i) for i, n in enumerate(blame_node.value))
                                         if s is not None)
    if fields.get("target") == "cause" and fields.get("scope", "node") != "job":
        c.error(keys["target"][1], "target: cause looks for the node behind a job-wide symptom; it needs scope: job")
    guards = fields.get("guards")
    gpu_steps = [s for s in (*steps, *(guards.repeat_then if guards else ()), *fields.get("blame_plan", ()))
                 if s.action in GPU_STEPS]
    if gpu_steps and fields.get("scope", "node") != "gpu":
        c.error(keys["plan"][1], f"{gpu_steps[0].action} acts on the incident's GPU; it needs scope: gpu")
    for plan_steps in (steps, fields.get("blame_plan", ()), guards.repeat_then if guards else ()):
        _requeue_after_drain(c, node, plan_steps)
    per_gpu = [r.name for r in (guards.history if guards else ()) if r.name != HistoryRuleName.REMEDIATIONS]
    if per_gpu and fields.get("scope", "node") != "gpu":
        c.error(keys["guards"][1], f"guards.history.{per_gpu[0]} reads the incident's GPU; it needs scope: gpu")
    if isinstance(trigger, MetricTrigger) and trigger.condition.per_gpu is False and fields.get("scope") == "gpu":
        c.error(keys["scope"][1], f"scope gpu needs a gpu.* metric; {trigger.condition.metric} is read per node")
    if len(c.errors) > before or name is None or trigger is None:
        return None
    return Playbook(name=name, trigger=trigger, plan=tuple(steps), source=c.path,
                    line=node.start_mark.line + 1, **fields)


def _consequence_of(c: _Checker, node: Node) -> dict[str, Any]:
    """``consequence_of: {events: [xid, ...], within: 2m}``: the faults this symptom follows from."""
    keys = c.mapping(node, ("events", "within"), "consequence_of")
    if not isinstance(node, MappingNode):
        return {}
    if "events" not in keys:
        c.error(node, "consequence_of needs events: the event kinds whose incidents this symptom follows from")
        return {}
    kinds = c.items(keys["events"][1], "consequence_of.events", lambda n: _event_kind(c, n))
    fields: dict[str, Any] = {"consequence_of": tuple(k for k in kinds if k is not None)}
    if "within" in keys:
        within = c.duration(keys["within"][1], "consequence_of.within")
        if within is not None:
            fields["consequence_within"] = within
    return fields


def _requeue_after_drain(c: _Checker, where: Node, steps: Sequence[Step]) -> None:
    """A job requeued before its node is drained may be started on that node again."""
    names = [s.action for s in steps]
    if "requeue_job" in names and "drain_node" not in names[:names.index("requeue_job")]:
        line = next(s.line for s in steps if s.action == "requeue_job")
        c.errors.append(PlaybookError(c.path, line or where.start_mark.line + 1, 1,
                                      "requeue_job needs a drain_node before it in the same plan "
                                      "(a job requeued onto a node still in the pool may start there again)"))


def check_text(text: str, path: str) -> tuple[list[Playbook], list[PlaybookError]]:
    """Every playbook in ``text`` (one YAML document each) and every error found."""
    c = _Checker(path)
    playbooks: list[Playbook] = []
    try:
        documents = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = " ".join(p for p in (exc.context, exc.problem) if p)
        return [], [PlaybookError(path, line, col, f"not valid YAML: {problem}")]
    except yaml.YAMLError as exc:
        return [], [PlaybookError(path, 1, 1, f"not valid YAML: {exc}")]
    documents = [d for d in documents if d is not None]
    if not documents:
        return [], [PlaybookError(path, 1, 1, "the file holds no playbook")]
    for doc in documents:
        playbook = _playbook(c, doc)
        if playbook is not None:
            playbooks.append(playbook)
    return playbooks, c.errors
