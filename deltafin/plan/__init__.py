"""Planning, pure (no I/O, no torch: tests/test_structure.py imports it alone), in three rooms under the deciders:
memory/ (what a stage holds: the one memory model), cluster/ (the cluster as the planner sees it: workers, links,
compute, and the plan made of it with its expert placement) and timing/ (what a plan takes: a token's and a prompt's
time). Here, on top of them: planner.py (layers over workers), modes.py (wide or local experts) and outlook.py (what
a longer context or more memory would give).

May import: basics, formats, checkpoint, kernels, models, plan.memory, plan.cluster and plan.timing.
"""
