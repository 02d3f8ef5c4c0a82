"""The coordinator's libraries: cluster/ (the backend, the workers, recovery), engine/ (the token loop, scheduler,
prefix index) and http/ (the HTTP transport and one adapter per API). Its process, `deltafin-coordinator`, and the
commands over it (the terminal chat, the demo, the benchmarks) are entry points in deltafin/cli/.
"""
