"""Stateful engine service: scheduler, paged KV cache, model runner, sampler."""
