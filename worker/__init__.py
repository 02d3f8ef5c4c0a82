"""The deltafin-worker daemon: a gRPC servicer over one Stage."""
