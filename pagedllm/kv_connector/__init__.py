"""KV connector: KV blocks move out of and into the engine by content hash.

One mechanism, two uses: a prefix cache that outlives the process and is shared by replicas
(``kv_both`` on a directory), and disaggregated prefill/decode (a producer saves what it
prefills, a consumer loads it). See docs/kv_connector.md.

    scheduler side (scheduler_side.py)          worker side (worker_side.py)
    lookup: how many prompt tokens beyond       load: verified payloads -> the fresh block
      the local prefix cache the store holds      ids, before the forward
    on_allocated: the block ids they go to      save: copy newly full blocks out after the
    build_meta: the step's loads and saves        forward; a thread writes them to the store
                         \\                     /
                          store (base.KVStore; disk_store.py)
"""
