"""The wire: what both ends of every link import (frames, framing, the trainer control contract, XIDs, exit codes)."""
