"""The client library engines import (extra ``engine``): the only code that touches NIXL or
torch, and nothing of the broker's server side.

``nixl_transport`` wraps NIXL; ``session`` holds what both clients share (broker channel, one
registered rank, lease keep-alive); ``prefill`` and ``decode`` are the clients, each async
(``AsyncPrefillClient``) and blocking (``PrefillClient``); ``vllm`` is the vLLM KV connector.
"""
