"""pdbroker: a transfer broker for disaggregated prefill/decode serving of hybrid models.

The broker process depends only on grpcio, protobuf, numpy, OpenTelemetry and
prometheus-client; it never imports torch, nixl or vllm.
"""

__version__ = "0.1.0"
