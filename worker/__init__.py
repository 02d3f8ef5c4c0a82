"""The deltafin-worker daemon's library: the daemon (daemon.py, from its typed WorkerOptions), the gRPC servicer over
one stage (service.py) with its calls to other holders (peers.py). Its command is deltafin/cli/worker.py.

May import: basics, formats, checkpoint, text, kernels, models, plan, weights, runtime, transport.
"""
