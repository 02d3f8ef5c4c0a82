"""deltafin.download.fetch."""
