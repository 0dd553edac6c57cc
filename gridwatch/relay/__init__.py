"""gridwatch relay: carries a rack of agents to each console on one SSH link."""
