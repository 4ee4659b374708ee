"""Owns the model and its KV cache on one device, and runs one scheduled step at a time."""

from __future__ import annotations

import structlog
import torch

from tandem.engine_service.config import EngineConfig
from tandem.engine_service.worker.cuda_graphs import DecodeCudaGraphs, capture_sizes
from tandem.engine_service.worker.piecewise_graphs import PiecewiseCudaGraphs
from tandem.engine_service.worker.input_batch import (
    HostInputs,
    PinnedStaging,
    host_to_device,
)
from tandem.engine_service.worker.loader import build_model, read_eos_token_ids, resolve_model
from tandem.engine_service.cache.cache_spec import CacheLayout
from tandem.engine_service.cache.cache_tensors import CacheTensors, allocate_cache_tensors
from tandem.engine_service.cache.memory_plan import MemoryPlan, torch_dtype_name
from tandem.engine_service.worker.serving_plan import plan_model_cache, resolve_dtype, resolve_max_model_len
from tandem.engine_service.worker.state_copies import check_copies, copy_state_slots

log = structlog.get_logger(__name__)

def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when available, else cpu; anything else as torch spells it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class ModelRunner:
    """Loads the model, sizes and allocates the paged KV cache, and executes scheduled batches.

    `forward` turns a step's host inputs (built from the worker's rows) into float32 logits for
    the entries that sample; the runner holds no per-request state (the worker's rows do).

    The model declares its caches per layer group (`cache_layout`); the planner sizes each
    group (`memory_plan`, logged one line per group) and every group's tensors are allocated
    here (`cache_tensors`; `kv_caches` is the per-layer attention cache list the model reads).
    Each paged group holds `num_blocks + 1` blocks per layer: the block manager is given
    `num_blocks`, and the last one (`scratch_block`) is where the dummy rows of a padded
    CUDA-graph batch write. On CUDA, step inputs travel through pinned buffers without a host
    sync, and pure-decode steps replay captured CUDA graphs (unless `enforce_eager`, or the
    attention backend cannot be captured); steps with prefill rows replay graphs captured in
    pieces between attention calls (`piecewise_graphs.py`), for models without state groups.
    """

    def __init__(self, config: EngineConfig) -> None:
        mc, cc = config.model, config.cache
        self.device = resolve_device(mc.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = resolve_dtype(mc.dtype, self.device)
        resolved = resolve_model(mc.model, mc.cache_dir)
        self.model_path: str | None = resolved.path
        self.is_dummy = resolved.is_dummy
        self.model = build_model(
            resolved, self.device, self.dtype, seed=mc.seed, attention_backend=mc.attention_backend,
            quantization=mc.quantization,
        )
        self.attention_backend: str = self.model.attn_backend.name
        arch = self.model.config
        self.architecture = type(self.model).__name__
        # False for a model whose state a prefix hit cannot restore; every model here can (hybrid
        # ones restore their recurrent state from a state checkpoint), so this is a model's opt-out.
        self.supports_prefix_caching: bool = getattr(self.model, "supports_prefix_caching", True)
        self.arch_config = arch
        self.vocab_size = arch.vocab_size
        self.eos_token_ids = read_eos_token_ids(resolved)
        self.max_model_len = resolve_max_model_len(mc.max_model_len, arch)
        self.cache_layout: CacheLayout = self.model.cache_layout(torch_dtype_name(self.dtype))
        # The same planning path as `tandem plan` (`serving_plan.py`), with this device's free memory.
        self.memory_plan: MemoryPlan = plan_model_cache(
            self.cache_layout, arch, config, self.device, self.dtype, self.max_model_len)
        self.block_size = cc.block_size
        self.num_blocks = self.memory_plan.num_blocks
        if self.memory_plan.paged_groups[0].sliding_window is None and self.num_blocks * self.block_size < self.max_model_len:
            log.warning(
                "kv cache smaller than one full-length sequence",
                cache_tokens=self.num_blocks * self.block_size, max_model_len=self.max_model_len,
            )
        self.scratch_block = self.num_blocks  # one block past the pool the block manager sees
        self.cache_tensors: CacheTensors = allocate_cache_tensors(
            self.cache_layout, self.memory_plan, arch.num_hidden_layers, self.device
        )
        self._staging = PinnedStaging(self.device) if self.device.type == "cuda" else None
        self.cuda_graphs: DecodeCudaGraphs | None = None
        self.piecewise_graphs: PiecewiseCudaGraphs | None = None
        if self.device.type == "cuda" and not mc.enforce_eager:
            self._capture_cuda_graphs(config)
            self._capture_piecewise_graphs(config)

    @property
    def kv_caches(self) -> list[torch.Tensor | None]:
        """Per layer, the attention cache it reads (the model's `kv_caches` argument)."""
        return self.cache_tensors.kv_caches

    @property
    def layer_caches(self) -> list:
        """Per layer, what the model reads: its attention cache, or its state pools (a tuple)."""
        tensors = self.cache_tensors
        return tensors.kv_caches if not tensors.state else tensors.layer_caches()

    @kv_caches.setter
    def kv_caches(self, caches: list[torch.Tensor | None]) -> None:
        # Replaced, not copied: whoever swaps the caches (the throughput bench's HF peer) frees
        # the old tensors.
        self.cache_tensors.kv_caches = caches

    def _capture_cuda_graphs(self, config: EngineConfig) -> None:
        if not self.model.attn_backend.supports_cuda_graphs:
            log.info("cuda graphs off: the attention backend cannot be captured", backend=self.attention_backend)
            return
        windows = [g.sliding_window for g in self.memory_plan.paged_groups]
        graphs = DecodeCudaGraphs(
            self.model, self.layer_caches,
            sizes=capture_sizes(config.scheduler.max_num_seqs),
            block_size=self.block_size,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            scratch_block=self.scratch_block,
            num_kv_heads=self.arch_config.num_key_value_heads,
            device=self.device,
            # Bounds the split count when every layer is windowed (the widest window decides).
            sliding_window=None if None in windows else max(windows),
            # Each further paged group pads into its own scratch block, one past its pool.
            extra_scratch_blocks=[g.num_blocks for g in self.memory_plan.paged_groups[1:]],
            # Padded rows of a model with state groups write their state in the slot past the
            # request and checkpoint slots.
            scratch_state_slot=self.memory_plan.scratch_state_slot,
        )
        try:
            graphs.capture()
        except Exception:  # a capture failure costs speed, not correctness: run eagerly, loudly
            log.exception("cuda graph capture failed; decode runs eagerly")
            return
        self.cuda_graphs = graphs

    def _capture_piecewise_graphs(self, config: EngineConfig) -> None:
        max_tokens = min(config.model.prefill_graph_tokens, config.scheduler.max_num_batched_tokens)
        if max_tokens <= 0 or self.cache_tensors.state or not hasattr(self.model.attn_backend, "attend_hook"):
            log.info("piecewise cuda graphs off", max_tokens=max_tokens, state_groups=bool(self.cache_tensors.state),
                     backend=self.attention_backend)
            return
        graphs = PiecewiseCudaGraphs(
            self.model, self.layer_caches, max_tokens=max_tokens, block_size=self.block_size,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size), scratch_block=self.scratch_block,
            device=self.device,
            extra_scratch_blocks=[g.num_blocks for g in self.memory_plan.paged_groups[1:]],
        )
        try:
            graphs.capture()
        except Exception:  # as for decode graphs: speed lost, not correctness
            log.exception("piecewise cuda graph capture failed; steps with prefill rows run eagerly")
            return
        self.piecewise_graphs = graphs

    @torch.inference_mode()
    def copy_state_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy state slot src -> dst for each pair, in every state group's layer tensors (state
        checkpoints: restore before a step's forward, save after it). Queued; nothing waits."""
        tensors = [t for layers in self.cache_tensors.state.values() for ts in layers.values() for t in ts]
        if not tensors:
            raise RuntimeError("state copies planned for a model without state groups")
        check_copies(pairs, tensors[0].shape[0])
        copy_state_slots(tensors, pairs)

    @torch.inference_mode()
    def forward(self, host: HostInputs, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run a step's host inputs; float32 logits `[num_sampling, vocab]` in batch order.

        Returns without waiting for the device. Pending input tokens (overlapped scheduling)
        are read on the device from `previous_tokens`, the prior step's sampled tokens. The
        engine builds `host` from the worker's rows (`worker.StepWorker`)."""
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(host):
            return self.cuda_graphs.run(host, self._staging, previous_tokens)
        if self.piecewise_graphs is not None and self.piecewise_graphs.can_run(host):
            return self.piecewise_graphs.run(host, self._staging, previous_tokens)
        logits, _ = self.forward_eager(host, previous_tokens)
        return logits

    @torch.inference_mode()
    def forward_eager(self, host: HostInputs, previous_tokens: torch.Tensor | None = None,
                      hidden_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` without graphs; also the hidden states at the step's flat token indices
        `hidden_rows` (None: none), which prompt logprobs are computed from."""
        inputs = host_to_device(host, self.device, self._staging, previous_tokens)
        md = inputs.metadata
        hidden = self.model(inputs.input_ids, md.positions, self.layer_caches, md)
        logits = self.model.compute_logits(hidden.index_select(0, md.logits_indices)).float()
        return logits, (hidden.index_select(0, hidden_rows) if hidden_rows is not None else None)
