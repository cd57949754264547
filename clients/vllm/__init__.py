"""The vLLM 0.33 KV connector (``PdBrokerConnector`` in :mod:`clients.vllm.connector`) that moves
prompt state between prefill and decode engines through the broker; see ``docs/VLLM.md``.

Needs the ``vllm`` extra; no other module of ``broker`` or ``clients`` imports vLLM.
"""
