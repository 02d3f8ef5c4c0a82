"""deltafin.text."""
