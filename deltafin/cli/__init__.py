"""The `deltafin` command (commands.py), its option groups and their typed values (flags.py), benchmarks,
`inspect` and the console's logging: an entry point, so it may import anything, the coordinator included.
"""
