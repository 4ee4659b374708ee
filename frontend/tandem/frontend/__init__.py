"""Stateless frontend: text in, text out; talks to engine replicas over gRPC."""
