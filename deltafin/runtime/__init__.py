"""deltafin.runtime."""
