"""What a stage holds, from the config alone: the one memory model (sizing.py on stage_parts.py, layer_table.py,
forward_workspace.py and spill_cost.py), what a user may fix of it (sizing_options.py), an expert holder's plan
(holder_sizing.py), the default context, kept prefixes' grid, the least memory a stage plans in, the check of a plan
made elsewhere (stage_check.py), and the spine's format and converted copies as a stage's memory sees them.

May import: basics, formats, checkpoint, kernels, models.
"""
