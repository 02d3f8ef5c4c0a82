"""deltafin.checkpoint.shards."""
