"""Planning: the one model of a stage's memory (sizing.py), the memory a process may use (memory.py), the layer
partition across workers (planner.py) and the experts' placement across holders and disks (expert_placement.py).

May import: basics, formats, checkpoint, kernels, models.
"""
