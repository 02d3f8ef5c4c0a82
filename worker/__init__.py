"""The deltafin-worker daemon: main.py (the process, an entry point) and the gRPC servicer over one stage
(service.py) with its calls to other holders (peers.py).

May import: basics, formats, checkpoint, text, kernels, models, plan, weights, runtime, transport.
"""
