"""The deltafin-coordinator process: its commands at this level (main.py, the terminal chat, the demo, the serving
benchmark, the workload benchmark: entry points), over cluster/ (the backend, the workers, recovery), engine/ (the
token loop, scheduler, prefix index) and http/ (the HTTP transport and one adapter per API).
"""
