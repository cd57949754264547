"""Where the broker's records live: the storage contract (:mod:`broker.store.contract`), the
in-memory default (:mod:`broker.store.memory`) and Redis, shared by replicas
(:mod:`broker.store.redis`)."""
