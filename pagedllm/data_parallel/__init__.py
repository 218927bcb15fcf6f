"""Data parallelism: N engine replicas, each in its own process, behind one load balancer.

    API process: InputProcessor (validate + tokenize) -> LoadBalancer.choose -> ReplicaClient
    replica process (core_proc.py): commands in -> LLMEngine.step() -> outputs + step stats out
"""
