"""The wire: the codec (tensors, options, plans and counters <-> messages, checked), the generated gRPC code and
its generator (protoc.py), gRPC status codes, authentication, liveness probes, ports and Bonjour discovery.

May import: basics, formats, checkpoint, kernels, models, plan, weights, runtime.
"""
