"""Generated protobuf and gRPC modules for the tandem.v1 contracts."""
