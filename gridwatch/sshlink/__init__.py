"""The SSH layer both ends share: the algorithm policy, keys and pinning, the role-key server, the client links."""
