"""The membership coordinator: who is in each generation, decided from heartbeats, with an injected clock."""

from __future__ import annotations

import msgspec
import pytest

from gridwatch.trainer.membership import Coordinator, Generation, Heartbeat, newest_gen, read_gen, wait_for_gen


class DictStore:
    """The four store calls the coordinator and heartbeats use, over a dict (a TCPStore in production)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def add(self, key: str, value: int) -> int:
        n = int(self.data.get(key, b"0")) + value
        self.data[key] = str(n).encode()
        return n

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Cluster:
    """A coordinator and workers that beat only when told to (so a test decides who is alive)."""

    def __init__(self, **options: object) -> None:
        self.store = DictStore()
        self.clock = Clock()
        self.coord = Coordinator(self.store, self.clock, **options)  # type: ignore[arg-type]
        self.beats: dict[str, Heartbeat] = {}

    def start(self, node: str) -> Heartbeat:
        hb = Heartbeat(self.store, node)
        hb.register()  # no thread: the test beats for it
        self.beats[node] = hb
        return hb

    def beat(self, *nodes: str) -> None:
        for node in nodes:
            self.beats[node].beat()

    def run(self, seconds: float, alive: tuple[str, ...], step: float = 0.25) -> list[Generation]:
        """Advance time; the ``alive`` workers beat every step; returns what was published."""
        out = []
        for _ in range(int(seconds / step)):
            self.clock.advance(step)
            self.beat(*alive)
            gen = self.coord.tick()
            if gen is not None:
                out.append(gen)
        return out

    def form(self, *nodes: str) -> Generation:
        for node in nodes:
            self.start(node)
        gens = self.run(self.coord.first_window + 1, nodes)
        assert len(gens) == 1
        for node in nodes:
            self.beats[node].set(f"member {gens[0].gen}")
        return gens[0]


def test_first_generation_waits_for_min_nodes_then_the_window_or_max_nodes() -> None:
    c = Cluster(min_nodes=2, max_nodes=3, first_window=5.0)
    c.start("node-1")
    assert c.run(10, ("node-1",)) == [], "one node is below --min-nodes: nothing forms"
    c.start("node-2")
    assert c.run(4, ("node-1", "node-2")) == [], "the window waits for more"
    gens = c.run(2, ("node-1", "node-2"))
    assert [(g.gen, g.members, g.sync) for g in gens] == [(1, ["node-1", "node-2"], "restore")]
    c2 = Cluster(min_nodes=1, max_nodes=2, first_window=60.0)
    c2.start("a")
    c2.start("b")
    assert [g.members for g in c2.run(0.5, ("a", "b"))] == [["a", "b"]], "max nodes ends the window at once"
    assert read_gen(c2.store, newest_gen(c2.store)) == c2.coord.current


def test_a_planned_leave_keeps_memory_and_a_join_shares_it() -> None:
    c = Cluster()
    c.form("node-1", "node-2", "node-3")
    c.beats["node-2"].set("leave 1")
    gens = c.run(0.25, ("node-1", "node-2", "node-3"))
    assert [(g.members, g.sync) for g in gens] == [(["node-1", "node-3"], "none")]
    c.beats["node-2"].stop("done")
    c.beat("node-1", "node-3")
    # The node comes back repaired: a new process asks to join; it is taken after the join window.
    c.start("node-2")
    gens = c.run(2.0, ("node-1", "node-2", "node-3"))
    assert [(g.gen, g.members, g.sync) for g in gens] == [(3, ["node-1", "node-3", "node-2"], "share")]


def test_a_dead_member_is_dropped_and_its_stale_heartbeat_is_not_a_join() -> None:
    c = Cluster(dead_after=2.0)
    c.form("node-1", "node-2", "node-3")
    assert c.run(1.5, ("node-1", "node-3")) == [], "not dead yet"
    gens = c.run(1.0, ("node-1", "node-3"))
    assert [(g.members, g.sync) for g in gens] == [(["node-1", "node-3"], "restore")]
    assert c.run(5.0, ("node-1", "node-3")) == [], "node-2's last heartbeat does not bring it back"


def test_a_failed_collective_drops_the_quiet_member_without_waiting_for_it_to_time_out() -> None:
    c = Cluster(dead_after=30.0, quiet_after=0.8)
    c.form("node-1", "node-2", "node-3")
    c.beats["node-3"].set("failed 1")  # node-3 saw the connection to node-1 reset
    gens = c.run(1.25, ("node-2", "node-3"))
    assert [(g.members, g.sync) for g in gens] == [(["node-2", "node-3"], "restore")], "in about a second, not 30"


def test_everyone_failing_with_no_one_gone_re_forms_the_same_members_from_a_checkpoint() -> None:
    c = Cluster(failed_wait=5.0)
    c.form("a", "b")
    c.beats["a"].set("failed 1")
    assert c.run(1.0, ("a", "b")) == [], "b may be about to report too"
    c.beats["b"].set("failed 1")
    gens = c.run(0.25, ("a", "b"))
    assert [(g.members, g.sync) for g in gens] == [(["a", "b"], "restore")]


def test_a_restarted_member_is_a_new_process_and_comes_back_in_with_a_restore() -> None:
    c = Cluster(dead_after=30.0)
    c.form("a", "b")
    c.start("b")  # torchrun restarted b's worker: same name, new incarnation, asking to join
    gens = c.run(0.25, ("a", "b"))
    assert [(g.members, g.sync) for g in gens] == [(["a", "b"], "restore")]


def test_members_killed_together_restore_together_when_one_restarts_late() -> None:
    # A lost GPU kills b's worker; NCCL's watchdog kills a's. b's restart beats first. Restored alone, b would
    # take its own newest checkpoint, and a, let in later by a share, would throw away its newer one.
    c = Cluster(dead_after=2.0, rejoin_wait=3.0)
    c.form("a", "b")
    assert c.run(2.25, ()) == [], "both gone: no one to train"
    c.start("b")  # b's new process, asking to join
    assert c.run(1.5, ("b",)) == [], "a's restart may come: its checkpoints may be the newest"
    c.start("a")  # 1.5 s later
    gens = c.run(0.25, ("a", "b"))
    assert [(g.members, g.sync) for g in gens] == [(["a", "b"], "restore")], "one restore, both checkpoints in it"


def test_members_killed_together_restore_without_one_that_does_not_come_back() -> None:
    c = Cluster(dead_after=2.0, rejoin_wait=3.0)
    c.form("a", "b")
    assert c.run(2.25, ()) == []
    c.start("b")
    assert c.run(2.5, ("b",)) == [], "within the rejoin wait"
    gens = c.run(1.0, ("b",))
    assert [(g.members, g.sync) for g in gens] == [(["b"], "restore")], "a's node is down for good: b goes on"
    assert c.run(5.0, ("b",)) == [], "a's last heartbeat does not bring it back"


def test_members_that_came_back_once_still_wait_for_each_other_after_a_later_failure() -> None:
    c = Cluster(dead_after=2.0, rejoin_wait=3.0)
    c.form("a", "b")
    assert c.run(2.25, ()) == [], "both quiet (the store was out of reach)"
    assert c.run(60.0, ("a", "b")) == [], "the same processes back: training goes on, nothing to re-form"
    assert c.run(2.25, ()) == [], "now both killed"
    c.start("b")
    assert c.run(1.5, ("b",)) == [], "the wait counts from this failure, not the quiet a minute ago"
    c.start("a")
    gens = c.run(0.25, ("a", "b"))
    assert [(g.members, g.sync) for g in gens] == [(["a", "b"], "restore")]


def test_below_min_nodes_the_job_waits_and_a_finishing_run_is_left_alone() -> None:
    c = Cluster(min_nodes=2, dead_after=1.0)
    c.form("a", "b")
    assert c.run(3.0, ("a",)) == [], "one node left is below --min-nodes: wait for a joiner"
    c2 = Cluster()
    c2.form("a", "b")
    c2.beats["a"].stop("done")
    assert c2.run(5.0, ("b",)) == [], "a member done means the run is over, not failed"


def test_garbage_in_the_store_is_ignored() -> None:
    c = Cluster()
    c.form("a", "b")
    c.store.set("gw/hb/a", "\x1b[31m nonsense")
    c.store.set("gw/reg/99", b"\xff\xfe")
    c.store.add("gw/nreg", 5)
    gens = c.run(3.0, ("b",))
    assert [g.members for g in gens] == [["b"]], "a's heartbeat is unreadable: a counts as gone, nothing raises"


def test_wait_for_gen_skips_generations_without_the_node() -> None:
    store = DictStore()
    for members in (["a"], ["a", "b"]):
        gen = newest_gen(store) + 1
        store.set(f"gw/gen/{gen}", msgspec.json.encode(Generation(gen=gen, members=members, sync="share")))
        store.add("gw/gen", 1)
    clock = Clock()
    got = wait_for_gen(store, 0, "b", 1.0, clock, clock.advance)
    assert got is not None and got.gen == 2
    assert wait_for_gen(store, 2, "b", 1.0, clock, clock.advance) is None, "times out with nothing newer"


@pytest.mark.parametrize("value", ["", "x", "member", "member x", "join 1 2"])
def test_odd_states_parse_without_raising(value: str) -> None:
    from gridwatch.trainer.membership import parse_state

    assert parse_state(value)[0] in ("unknown", "member", "join")


def test_a_worker_counted_before_its_name_is_written_is_not_lost() -> None:
    c = Cluster(first_window=1.0)
    c.start("a")
    c.store.add("gw/nreg", 1)  # b has taken its number; the coordinator ticks before b writes its name
    assert c.run(0.25, ("a",)) == []
    index = int(c.store.get("gw/nreg"))
    c.store.set(f"gw/reg/{index}", "b")
    c.beats["b"] = Heartbeat(c.store, "b")
    c.beats["b"].beat()
    gens = c.run(2.0, ("a", "b"))
    assert [g.members for g in gens] == [["a", "b"]]
