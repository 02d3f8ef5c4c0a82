"""`deltafin download`: a worker's share of a checkpoint from a directory or the Hugging Face Hub, verified and
resumable (fetch.py; sources.py: where the files come from).

May import: basics, formats, checkpoint, plan.
"""
