"""Checks that need a GPU: each is a module run as `python -P -m tandem.gpu_checks.<name> --out DIR`."""
