"""deltafin.plan."""
