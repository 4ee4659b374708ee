"""Engine configuration: one dataclass, validated once at start."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    """Limits the continuous-batching scheduler works within."""

    max_num_seqs: int = 64  # running sequences at once
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    enable_chunked_prefill: bool = True
    # Fair prefill: at most this many prompt tokens of one sequence per step, so a long prompt is
    # spread over steps and a short request admitted meanwhile gets its first token after a step
    # of bounded size. 0 turns the cap off (a prefill takes whatever budget is left); None picks
    # a default for the device (`prefill_cap`).
    max_prefill_tokens_per_seq: int | None = None
    max_waiting_requests: int = 1024  # bounded waiting queue (requests)
    max_waiting_tokens: int = 1 << 20  # bounded waiting queue (prompt tokens)
    # Overlapped scheduling: build and launch step N+1 while step N runs on the device.
    # "auto": on for CUDA devices, off on CPU (where the forward runs on the host anyway).
    overlap_scheduling: str = "auto"

    def prefill_cap(self, device_type: str) -> int:
        """The per-sequence prompt tokens of one step on `device_type` ("cuda" or "cpu"), 0: none.

        Defaults: 512 on CUDA (a 512-token step of an 8B model takes ~10 ms on an H200, so a short
        request waits about that long behind a long prompt, while long prompts still run in large
        chunks); 16 on CPU, where SmolLM2-135M on two cores costs ~50 ms a step plus ~5 ms a
        token, and the uncached tail of a short chat request is ~15 tokens: a step with a long
        prompt's chunk and that tail costs well under twice the tail alone.
        """
        if self.max_prefill_tokens_per_seq is not None:
            return self.max_prefill_tokens_per_seq
        return 512 if device_type == "cuda" else 16

    def validate(self) -> None:
        if self.overlap_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"overlap_scheduling must be auto, on or off, got {self.overlap_scheduling!r}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_prefill_tokens_per_seq is not None and self.max_prefill_tokens_per_seq < 0:
            raise ValueError("max_prefill_tokens_per_seq must be >= 0 (0: no cap)")
        if self.max_waiting_requests < 1 or self.max_waiting_tokens < 1:
            raise ValueError("waiting-queue bounds must be >= 1")


@dataclass
class CacheConfig:
    """Paged KV cache shape and sizing."""

    block_size: int = 16
    num_blocks: int | None = None  # fixed pool size; None lets the memory planner size it
    memory_fraction: float = 0.9  # of free device memory (GPU) after weights
    cpu_kv_cache_bytes: int = 1 << 30  # pool budget on CPU when num_blocks is None
    enable_prefix_caching: bool = True

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError("memory_fraction must be in (0, 1]")


@dataclass
class ModelConfig:
    """Which model to load, and how."""

    model: str = "smollm2-135m-instruct"  # embedded name, HF directory, .gguf file or dummy:<config>
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    device: str = "auto"  # auto: cuda if available else cpu
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    seed: int = 0  # for dummy weights
    cache_dir: str | None = None  # where converted GGUF models are kept
    attention_backend: str = "auto"  # auto: triton on CUDA, torch reference on CPU; or torch / triton
    enforce_eager: bool = False  # never capture CUDA graphs (decode runs eagerly)

    def validate(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig

    @classmethod
    def default(cls, **model_kwargs) -> "EngineConfig":
        return cls(ModelConfig(**model_kwargs), CacheConfig(), SchedulerConfig())

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
