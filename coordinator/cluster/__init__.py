"""deltafin.coordinator.cluster.workers."""
