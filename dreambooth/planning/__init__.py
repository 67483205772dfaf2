"""Everything decided before a run starts: the flags' plan, the inputs, the run's identity and its checkpoints, resources, memory and disk."""
