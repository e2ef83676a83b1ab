"""Plain reference forwards: one sequence, whole context, no paging or batching. The oracles the engine's
fast models are tested against (no public implementation exists for these models)."""
