"""deltafin.coordinator.engine.engine."""
