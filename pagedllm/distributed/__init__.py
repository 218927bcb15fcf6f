"""Tensor and pipeline parallelism over torch.distributed: ranks and groups (parallel_state),
which weights a rank holds (sharding), the collectives a shard adds to the model
(tensor_parallel) and stage-to-stage hand-over (pipeline). See docs/parallelism.md."""
