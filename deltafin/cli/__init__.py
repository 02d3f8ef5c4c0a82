"""deltafin.cli.commands."""
