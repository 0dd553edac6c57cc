"""An agent's request budget per key, seen from the console: a burst is sent again when the agent says a token is
back, a key spent for long is refused at once. Real agents, real SSH on loopback."""

from __future__ import annotations

import asyncio

from gridwatch.sshlink.client import Fleet, FleetOptions
from gridwatch.sshlink.hostlist import parse_endpoints
from gridwatch.wire import protocol as p
from tests.conftest import start_agent, stop_agent, wait_until


def _fleet(ra, keys) -> Fleet:  # noqa: ANN001
    return Fleet(parse_endpoints(ra.spec), FleetOptions(key_path=str(keys.operator_key), known_hosts=str(keys.known_hosts),
                                                        backoff_min=0.05, backoff_max=0.3))


async def test_a_burst_over_the_budget_is_sent_again_when_a_token_is_back(keys) -> None:  # noqa: ANN001
    # Two at once, then one every 0.2 s: a take-over's re-reads and an operator's ping arriving together.
    ra = await start_agent(keys, name="node-1", action_burst=2, action_rate=5.0)
    fleet = _fleet(ra, keys)
    await fleet.start()
    try:
        await wait_until(lambda: fleet.connected == 1, 10, "the link")
        answers = await asyncio.gather(*(fleet.action("node-1", "ping", reason="test") for _ in range(4)))
        assert all(a.ok for a in answers), [a.message for a in answers]
        assert ra.agent.refused_requests >= 2, "the agent refused the two over its budget, and they came again"
    finally:
        await fleet.stop()
        await stop_agent(ra)


async def test_a_key_spent_for_long_is_refused_to_its_caller_at_once_with_the_code(keys) -> None:  # noqa: ANN001
    ra = await start_agent(keys, name="node-1", action_burst=1, action_rate=0.01)  # a token every 100 s
    fleet = _fleet(ra, keys)
    await fleet.start()
    try:
        await wait_until(lambda: fleet.connected == 1, 10, "the link")
        assert (await fleet.action("node-1", "ping", reason="test")).ok
        refused = await fleet.action("node-1", "ping", reason="test", timeout=20.0)
        assert not refused.ok and refused.code == p.ResultCode.OVER_BUDGET, refused
        assert "over its budget" in refused.message and refused.data["retry_after_s"] > 2
        assert ra.agent.refused_requests == 1, "asked once, not again and again while the key stays spent"
    finally:
        await fleet.stop()
        await stop_agent(ra)
