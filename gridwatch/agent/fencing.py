"""Fencing and step keys on the agent: an old leader's request is refused, a repeated step is answered, not redone.

Each acting request may carry the sending console's fencing token
(``Action.fence``, its etcd lease's revision). The agent keeps the newest token
it has seen and refuses an older one, so a console that was paused or cut off
past its lease cannot act after another took over. A playbook step carries a
key (``Action.key``, ``<incident>/<step index>``); the first successful outcome
of a key is kept, and a repeat (the standby finishing a plan its predecessor
left half-done) gets that outcome back without the action running again. A
failed outcome is not kept: it changed nothing a retry must not redo (a
restart sent while the job re-forms is sent again on purpose).

Both survive an agent restart when the agent has a state file: they are kept
beside it, in ``<state_file>.fencing.json`` (private, replaced atomically).
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from gridwatch.wire import protocol as p

if TYPE_CHECKING:
    from gridwatch.agent.agent import Agent
    from gridwatch.sshlink.server import Caller

# Step outcomes kept per agent; the oldest go first (a plan is finished long before a thousand more steps).
MAX_KEYS = 1000
# What of a first outcome's data a repeat gets back too: where a captured scene is, so that the console
# finishing a plan can still copy it off the node.
KEPT_DATA = ("path",)

Handler = Callable[["Agent", "Caller", p.Action], Coroutine[Any, Any, p.ActionResult]]


def refusal(token: int, newest: int) -> str:
    """The one line an agent answers a request from an older console with."""
    return (f"refused: fencing token {token} is older than {newest} (a newer console leads; if etcd was rebuilt "
            f"empty, run: gridwatch fencing raise --past {newest})")


@dataclass(slots=True)
class Outcome:
    action: str
    message: str
    data: dict[str, str] = field(default_factory=dict)


class FenceBook:
    """The newest fencing token and the first outcome of each step key, for one agent."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.newest = 0
        self.steps: OrderedDict[str, Outcome] = OrderedDict()
        self.running: dict[str, asyncio.Future[p.ActionResult]] = {}
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            self.newest = int(data.get("newest", 0))
            for key, action, message, *rest in data.get("steps", [])[-MAX_KEYS:]:
                kept = rest[0] if rest and isinstance(rest[0], dict) else {}  # a file from before data was kept
                self.steps[str(key)] = Outcome(str(action), str(message), {str(k): str(v) for k, v in kept.items()})
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            # Starting with no memory is safe for fencing (the next leader's token is taken as the newest) but
            # not for step keys: say so loudly.
            logger.error("fencing file {} unreadable ({}); starting with no fencing token and no step keys", path, exc)

    def _save(self) -> None:
        if self.path is None:
            return
        from gridwatch.agent.durable import _write_durably

        data = {"newest": self.newest, "steps": [[k, o.action, o.message, o.data] for k, o in self.steps.items()]}
        _write_durably(self.path, json.dumps(data).encode())

    def admit(self, token: int | None) -> str | None:
        """None if a request with ``token`` may act (a newer token is kept first), else the refusal."""
        if token is None:
            return None
        if token < self.newest:
            return refusal(token, self.newest)
        if token > self.newest:
            self.newest = token
            self._save()  # before acting: a restart must not forget who leads now
        return None

    def first(self, key: str, action: str) -> Outcome | None:
        found = self.steps.get(key)
        return found if found is not None and found.action == action else None

    def remember(self, key: str, action: str, message: str, data: dict[str, str] | None = None) -> None:
        self.steps[key] = Outcome(action, message, data or {})
        self.steps.move_to_end(key)
        while len(self.steps) > MAX_KEYS:
            self.steps.popitem(last=False)
        self._save()


_books: weakref.WeakKeyDictionary[Agent, FenceBook] = weakref.WeakKeyDictionary()


def book_for(agent: Agent) -> FenceBook:
    """The agent's book, read from beside its state file the first time it is asked for."""
    book = _books.get(agent)
    if book is None:
        state = agent.config.state_file
        book = FenceBook(Path(f"{state}.fencing.json") if state else None)
        _books[agent] = book
    return book


def guarded(handler: Handler) -> Handler:
    """``handler`` behind the fencing token check and the step key memory."""

    async def run(agent: Agent, caller: Caller, action: p.Action) -> p.ActionResult:
        book = book_for(agent)
        name = str(action.action)
        try:
            refused = book.admit(action.fence)
        except OSError as exc:
            return _answer(action, False, f"refused: the fencing token could not be kept in {book.path} "
                                          f"({exc.strerror or exc}); free the disk or fix the path", fenced=True)
        if refused is not None:
            agent.log.warning("{} from {}: {} (step {})", refused, caller, name, action.key or "-")
            return _answer(action, False, refused, fenced=True)
        key = str(action.key) if action.key else None
        if key is None:
            return await handler(agent, caller, action)
        first = book.first(key, name)
        if first is not None:
            agent.log.info("step {} ({}) was done already; answered with its first outcome", key, name)
            return _answer(action, True, first.message, repeat=True, **first.data)
        if key in book.running:
            # The same step sent twice at once (a console and its successor): the second waits for the first.
            result = await asyncio.shield(book.running[key])
            return _answer(action, result.ok, str(result.message), repeat=True, **_kept(result))
        done: asyncio.Future[p.ActionResult] = asyncio.get_running_loop().create_future()
        book.running[key] = done
        try:
            result = await handler(agent, caller, action)
            if result.ok:
                try:
                    book.remember(key, name, str(result.message), _kept(result))
                except OSError as exc:
                    agent.log.error("step {} done but not kept in {}: {}", key, book.path, exc.strerror or exc)
            done.set_result(result)
            return result
        except BaseException as exc:
            done.set_exception(exc)
            done.exception()  # retrieved: a waiter may not exist
            raise
        finally:
            book.running.pop(key, None)

    run.__name__ = getattr(handler, "__name__", "handler")
    return run


def _kept(result: p.ActionResult) -> dict[str, str]:
    return {k: str(v) for k, v in result.data.items() if k in KEPT_DATA and isinstance(v, str)}


def _answer(action: p.Action, ok: bool, message: str, **data: object) -> p.ActionResult:
    # changed=False: nothing was done now, so the agent publishes no action event for it.
    return p.ActionResult(id=action.id, action=action.action, ok=ok, message=p.Text(message), data={"changed": False, **data})
