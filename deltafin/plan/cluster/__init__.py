"""The cluster as the planner sees it, and the plan made of it: each worker's capacity, measured compute
(compute.py) and links (links.py); the plan's value (cluster_plan.py: a PlannedStage a stage, the ClusterPlan of them
all, its table) and where wide experts run (expert_placement.py, prompt_split.py).

May import: basics, formats, checkpoint, kernels, models, plan.memory.
"""
