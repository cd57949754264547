"""The client library engines import (extra ``engine``): the only code that touches NIXL or
torch, and nothing of the broker's server side (of :mod:`broker`, only the wire codec,
layouts, models, limits, errors, logs, tracing and :mod:`broker.client_security`).

``protocol`` builds the broker's requests and makes its calls (failover over replicas,
reconciliation of a publish whose reply was lost); ``transport`` is the seam to the memory a
rank registers and reads (``nixl_transport`` for engines, no memory for load tests);
``session`` holds what both clients share (one registered rank, lease keep-alive);
``prefill`` and ``decode`` are the clients, each async (``AsyncPrefillClient``) and blocking
(``PrefillClient``); ``vllm`` is the vLLM KV connector.
"""
