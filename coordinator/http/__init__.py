"""deltafin.coordinator.http."""
