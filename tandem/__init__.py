"""Tandem: an LLM inference server split in two over gRPC."""
__version__ = "0.1.0"
