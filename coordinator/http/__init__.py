"""The HTTP API: the transport (server.py: routes, SSE, errors, the web chat's files; ollama_routes.py: Ollama's
routes), the one generation request every API maps to (request.py), one adapter per client API (openai_api.py,
anthropic_api.py, ollama_api.py, responses_api.py: its bodies in, its responses and error shape out; none imports
another), /metrics and /v1/status.

May import: basics, formats, checkpoint, text, kernels, models, plan, weights, runtime, transport, coordinator.engine.
"""
