"""What a plan takes: a forward's stage hops (hops.py) and a decoded token's and a prompt's first token's time, split
into the disks', the links' and the compute's (predict.py).

May import: basics, formats, checkpoint, kernels, models, plan.memory, plan.cluster.
"""
