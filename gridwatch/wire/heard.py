"""Who was heard from longest ago: the nodes a silence check need look at, without walking the fleet.

A console, its engine and its links each ask a few times a second which nodes have gone quiet. Walking every
node for it costs O(fleet) each time, whether or not anyone is quiet (at 1,000 nodes a sizeable share of an
idle console's CPU). Frames arrive in time order, so keeping each node at the end of an ordered map when it is
heard puts the quietest at the front: a check reads from the front and stops at the first node heard recently.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# A watcher of silence that wakes this much later than it asked was stalled itself (a busy host, a long GC,
# a paused VM): the frames of that time may wait unread, so no silence up to then is held against a node.
LOOP_STALL_S = 0.2


class HeardOrder(Generic[K, V]):
    """Values by key, in the order they were last heard from (oldest first), with when; and each key's interval
    (how often it should be heard), counted so that the shortest is known without a walk.

    A clock that runs backwards (a test's, a replay's) only costs a sort at the next read: the order stays exact.
    """

    __slots__ = ("_items", "_last", "_ordered", "_every", "_intervals")

    def __init__(self) -> None:
        self._items: OrderedDict[K, tuple[float, V]] = OrderedDict()
        self._last = float("-inf")  # when the newest was heard
        self._ordered = True  # False once a time came in earlier than the newest: sorted again when read
        self._every: dict[K, float] = {}  # key -> its interval
        self._intervals: Counter[float] = Counter()  # interval -> how many keys have it

    def __len__(self) -> int:
        return len(self._items)

    def heard(self, key: K, value: V, at: float) -> None:
        """``key`` (``value``) was heard from at ``at``: it moves to the end."""
        items = self._items
        items[key] = (at, value)
        items.move_to_end(key)
        if at >= self._last:
            self._last = at
        else:
            self._ordered = False

    def every(self, key: K, interval: float) -> None:
        """``key`` should be heard every ``interval`` seconds from now on."""
        old = self._every.get(key)
        if old == interval:
            return
        counts = self._intervals
        if old is not None:
            counts[old] -= 1
            if counts[old] <= 0:
                del counts[old]
        counts[interval] += 1
        self._every[key] = interval

    def counted(self, key: K) -> bool:
        """Whether ``key``'s interval was given."""
        return key in self._every

    def shortest(self, default: float) -> float:
        """The shortest interval given; ``default`` when none was."""
        return min(self._intervals, default=default)

    def quiet(self, now: float, floor: float) -> list[V]:
        """The values last heard more than ``floor`` seconds before ``now``, oldest first: O(their number)."""
        self._order()
        quiet = []
        for at, value in self._items.values():
            if now - at <= floor:
                break
            quiet.append(value)
        return quiet

    def oldest(self) -> tuple[float, V] | None:
        """The value heard from longest ago, with when; None when there is none."""
        self._order()
        for found in self._items.values():
            return found
        return None

    def _order(self) -> None:
        if not self._ordered:
            self._items = OrderedDict(sorted(self._items.items(), key=lambda kv: kv[1][0]))
            self._last = max((at for at, _ in self._items.values()), default=float("-inf"))
            self._ordered = True
