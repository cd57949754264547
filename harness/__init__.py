"""The harness around pdbroker, built on the client library (:mod:`clients`) and shipped
outside the broker's image: the loopback fleet of ``pdbroker demo`` and the end-to-end tests
(:mod:`~harness.fleet`, :mod:`~harness.engines`, :mod:`~harness.brokers`, byte patterns in
:mod:`~harness.pattern`), the load of ``pdbroker soak`` (:mod:`~harness.soak`), the transfer
and control-plane benchmarks, an in-process OTLP receiver, planning fixtures
(:mod:`~harness.scenarios`, :mod:`~harness.cases`) and vLLM stand-ins that run on CPU
(:mod:`harness.vllm`). The broker's commands import it only when they run it.
"""
