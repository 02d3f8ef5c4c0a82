"""The HTTP API: the transport (server.py: routes, SSE, errors, the web chat's files), one adapter per client API
(openai_api.py, anthropic_api.py), /metrics and /v1/status.

May import: basics, checkpoint, text, kernels, models, plan, weights, runtime, transport, coordinator.engine.
"""
