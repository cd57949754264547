"""vLLM 0.33 on CPU without a model (:mod:`~harness.vllm.cpu_engine`: configs, KV-cache
groups and tensors as vLLM allocates them) and vLLM's own NIXL connector run side by side
with the planner (:mod:`~harness.vllm.nixl_reference`, ``pdbroker bench planner``). Needs the
``vllm`` extra.
"""
