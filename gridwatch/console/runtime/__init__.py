"""The one runtime: the fleet feeding the state store, the playbook engine and executor, closing the loop."""
