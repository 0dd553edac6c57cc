"""gridwatch: the on-call console for large GPU training runs (agent, console, playbooks, trainer)."""
