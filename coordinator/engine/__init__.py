"""The serving engine: admission, batching and pipelining (scheduler.py), the token loop (token_loop.py), the
prefix index, chat sessions and the reports of a run; what the HTTP API, the CLI and the Python API share.

May import: basics, formats, checkpoint, text, kernels, models, plan, weights, runtime, transport, coordinator.cluster.
"""
