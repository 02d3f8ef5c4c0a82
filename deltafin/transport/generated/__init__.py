"""Generated from proto/deltafin.proto by `python -m deltafin.transport.protoc`."""
