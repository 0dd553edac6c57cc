"""One rule for a node's name at every end: what a scheduler reads as every node, or a name with a newline,
names no node anywhere (the agent refuses to start as it, the console refuses its hello, Slurm is never told)."""

from __future__ import annotations

import pytest

from gridwatch.agent.config import ConfigError, load
from gridwatch.playbooks.scheduler import DrainRefused, check_node
from gridwatch.sshlink.client import hello_name_refusal
from gridwatch.sshlink.hostlist import Endpoint


@pytest.mark.parametrize("name", ["ALL", "all", "node1\n", "node[1-4]", "-n1", "a,b", ""])
def test_a_name_no_end_accepts(name: str) -> None:
    with pytest.raises(DrainRefused, match="refusing to act on"):
        check_node(name)
    assert hello_name_refusal(Endpoint("10.0.0.1", 8022), name).startswith("10.0.0.1:8022: the agent says it is")


def test_the_agent_will_not_start_as_a_name_consoles_refuse() -> None:
    with pytest.raises(ConfigError, match="--node-name: consoles would refuse the name 'ALL', which a scheduler"):
        load(None, {"node_name": "ALL"})
    assert load(None, {"node_name": "gpu-node-07.cluster"}).node_name == "gpu-node-07.cluster"
    assert check_node("gpu-node-07") == "gpu-node-07"
