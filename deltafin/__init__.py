"""Deltafin: run Kimi K3 on one or more Apple Silicon Macs."""

__version__ = "0.1.0"
