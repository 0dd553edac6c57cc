"""gridwatch: the on-call console for large GPU training runs (agent, console, playbooks, trainer)."""

import warnings

# cryptography 51 deprecates DSA, and asyncssh names DSA's types when it is imported: ten lines of warning on
# every command's stderr, ahead of its one-line answer. gridwatch accepts no DSA key (sshlink.policy), so the
# warning is about nothing it does; only that warning, from asyncssh, is silenced.
warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh(\.|$)")
