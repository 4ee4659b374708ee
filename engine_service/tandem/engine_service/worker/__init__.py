"""Step execution: model runner, request rows, input batch, CUDA graphs, sampler, loader (never imports core)."""
