"""Benchmarks: decode/prefill against the roofline, offline throughput against a peer, serving
over gRPC against the in-process engine, and the report that turns their JSON into docs.

Every benchmark writes one JSON file (see `results.py`) and never invents numbers: a part that
fails or runs out of time is recorded as such, and the others go on.
"""
