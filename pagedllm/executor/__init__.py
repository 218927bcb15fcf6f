"""The engine core's handle on the model: an Executor owning the workers (docs/parallelism.md)."""
