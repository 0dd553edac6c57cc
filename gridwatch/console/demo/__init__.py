"""Cluster in a box: agents, a trainer, the playbooks and the console on one machine."""
