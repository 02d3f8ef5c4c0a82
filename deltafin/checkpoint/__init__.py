"""The checkpoint as files: config.json as a typed ModelConfig (config.py), the safetensors index and shard
headers as tensor locations (shards.py), the presets of the synthetic checkpoints (presets.py), and what a partial
download holds (manifest.py). Nothing here reads tensor data.

May import: basics, formats.
"""
