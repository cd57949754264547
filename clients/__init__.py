"""Engine-side libraries (extra ``engine``): the only code that touches NIXL or torch.

``nixl_transport`` wraps NIXL; ``session`` holds what both clients share (broker channel, one
registered rank, lease keep-alive); ``prefill`` and ``decode`` are the clients, each async
(``AsyncPrefillClient``) and blocking (``PrefillClient``); ``pattern`` and ``loopback`` verify
transfers byte by byte and run a whole fleet on one host (``pdbroker demo``, end-to-end tests).
"""
