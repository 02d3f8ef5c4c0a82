"""Where the stages run: in-process stages or workers behind one Backend, finding, planning and assigning workers,
and keeping generation going when they fail (replay journal, re-planning, membership).

May import: basics, formats, checkpoint, text, kernels, models, plan, weights, runtime, transport.
"""
