"""The supervised trainer: elastic data-parallel workers, tiered checkpoints, a local control socket."""
