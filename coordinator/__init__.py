"""The deltafin-coordinator process: cluster client, generation loop, HTTP API."""
