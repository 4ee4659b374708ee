"""The engine's gRPC face: server, app wiring, core clients and metrics (imports core)."""
