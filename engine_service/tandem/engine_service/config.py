"""Engine configuration: one dataclass, validated once at start.

Each field that users may set carries its command-line declaration in `metadata` (help text,
and the flag's name where it differs from the field's). `tandem.options` turns these fields into
the argparse flags, `TANDEM_*` environment variables and `--config` file keys of `tandem serve`,
`tandem engine` and `tandem bench`, so a default or a help line is written once, here.
Metadata keys: `help`; `flag` (flag name without dashes); `choices`; `negate` (a bool that
defaults to True and is switched off by the flag); `scale` (flag value x scale = field value).

Each config validates itself when it is built (`__post_init__` runs its `validate`), so an
invalid one never exists and its readers (the engine, the scheduler, the runner) trust it.
Checks that need the loaded model (the unchunked step budget against the context length) stay
with the component that knows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _opt(default, help: str, **extra):
    """A field that is also a command-line flag (see the module docstring for `extra`)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class SchedulerConfig:
    """Limits the continuous-batching scheduler works within."""

    max_num_seqs: int = _opt(64, "most sequences running at once")
    max_num_batched_tokens: int = _opt(2048, "token budget of one step (prefill chunks + decodes)")
    enable_chunked_prefill: bool = True
    # Fair prefill: at most this many prompt tokens of one sequence per step, so a long prompt is
    # spread over steps and a short request admitted meanwhile gets its first token after a step
    # of bounded size. 0 turns the cap off; None picks a default for the device (`prefill_cap`).
    max_prefill_tokens_per_seq: int | None = _opt(
        None, "fair prefill: prompt tokens of one request per step, so a long prompt cannot hold up others; "
              "0: no cap (default: 512 on CUDA, 16 on CPU)")
    scheduling_policy: str = _opt("fcfs", "order of the waiting queue: fcfs (arrival order), or priority "
                                          "(a request's priority first, lower is earlier; arrival order "
                                          "among equals)", choices=("fcfs", "priority"))
    max_waiting_requests: int = _opt(1024, "bound of the waiting queue (requests)")
    max_waiting_tokens: int = _opt(1 << 20, "bound of the waiting queue (prompt tokens)")
    # Overlapped scheduling: build and launch step N+1 while step N runs on the device.
    overlap_scheduling: str = _opt("auto", "build and launch the next step while the current one runs on the "
                                           "device; auto: on for CUDA, off on CPU", choices=("auto", "on", "off"))

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

    def __post_init__(self) -> None:
        self.validate()

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


def check_checkpoint_stride(stride: int, block_size: int) -> None:
    """The state-checkpoint stride rule: a positive multiple of the block size, so every
    checkpoint position ends a block (a checkpoint is keyed by that block's hash)."""
    if stride < block_size or stride % block_size:
        raise ValueError(f"state_checkpoint_stride ({stride}) must be a positive multiple of "
                         f"block_size ({block_size})")


@dataclass
class CacheConfig:
    """Paged KV cache shape and sizing."""

    block_size: int = _opt(16, "tokens per KV block (a power of two)")
    num_blocks: int | None = _opt(None, "fix the KV pool size in blocks (default: sized by memory)",
                                  flag="num-kv-blocks")
    memory_fraction: float = _opt(0.9, "GPU: fraction of free memory (after weights) for the KV pool",
                                  flag="kv-cache-memory-fraction")
    cpu_kv_cache_bytes: int = _opt(1 << 30, "CPU: KV pool size in GiB", flag="cpu-kv-cache-gb", scale=1 << 30)
    enable_prefix_caching: bool = _opt(True, "turn prefix caching off", flag="no-prefix-caching", negate=True)
    # Hybrid models (recurrent state layers): prefix caching needs the state after the prefix too,
    # so a copy of it (a checkpoint) is kept every `state_checkpoint_stride` tokens of a prefill.
    state_checkpoint_stride: int | None = _opt(
        None, "models with recurrent state: tokens between the state checkpoints prefix caching keeps, a "
              "multiple of the block size; hits are rounded down to it (default: 512, or one block if larger)")
    state_checkpoint_memory_fraction: float = _opt(
        0.1, "models with recurrent state: share of the cache memory given to state checkpoints (the rest "
             "to KV blocks and request slots); 0: none, so such models get no prefix hits")

    def checkpoint_stride(self) -> int:
        """Tokens between state checkpoints (`state_checkpoint_stride`, or its default)."""
        if self.state_checkpoint_stride is not None:
            return self.state_checkpoint_stride
        return max(512, self.block_size)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        check_checkpoint_stride(self.checkpoint_stride(), self.block_size)
        if not 0.0 <= self.state_checkpoint_memory_fraction < 1.0:
            raise ValueError("state_checkpoint_memory_fraction must be in [0, 1)")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError("memory_fraction must be in (0, 1]")


@dataclass
class ModelConfig:
    """Which model to load, and how."""

    model: str = _opt("smollm2-135m-instruct", "embedded name, Hugging Face id (org/name, from the local HF "
                      "cache) or directory, .gguf file, or dummy:<config>")
    dtype: str = _opt("auto", "weight and activation dtype; auto: bfloat16 on GPU, float32 on CPU",
                      choices=("auto", "float32", "bfloat16", "float16"))
    device: str = _opt("auto", "auto, cpu or cuda[:N]; auto: cuda when available")
    max_model_len: int | None = _opt(None, "context length (default: the model's max_position_embeddings)")
    seed: int = _opt(0, "seed of dummy weights")
    cache_dir: str | None = _opt(None, "where converted GGUF models are kept (default: ~/.cache/tandem/models)")
    attention_backend: str = _opt("auto", "auto: Triton kernels on CUDA, PyTorch reference on CPU",
                                  choices=("auto", "torch", "triton"))
    enforce_eager: bool = _opt(False, "never capture CUDA graphs (decode, and steps with prefill rows)")
    prefill_graph_tokens: int = _opt(2048, "CUDA: steps with prefill rows of up to this many tokens (capped at "
                                     "max_num_batched_tokens) replay CUDA graphs captured in pieces between the "
                                     "attention calls, one set per token-count bucket (0: such steps run eagerly)")
    quantization: str = _opt("auto", "weights in FP8: auto (as the checkpoint stores them), fp8 (also "
                             "quantize a bf16/fp32 checkpoint to 128x128-block FP8 on load), none (dequantize an FP8 "
                             "checkpoint on load)", choices=("auto", "none", "fp8"))
    warmup_seconds: float = _opt(60.0, "GPU: before serving, run synthetic requests through the scheduler and "
                                 "kernels for at most this long, so kernels compile before the first request "
                                 "does (0: off)")
    # Where requests' unset sampling fields get their defaults (tandem.generation_defaults).
    generation_config: str = _opt("auto", "sampling defaults for fields a request leaves unset: auto (the "
                                  "model's generation_config.json, or the shipped defaults of an embedded "
                                  "model), none (neutral sampling), or a path to a generation_config.json")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.quantization not in ("auto", "none", "fp8"):
            raise ValueError(f"quantization must be auto, none or fp8, got {self.quantization!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if not self.warmup_seconds >= 0:
            raise ValueError(f"warmup_seconds must be >= 0, got {self.warmup_seconds!r}")
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0, got {self.prefill_graph_tokens!r}")


KV_ROLES = ("none", "producer", "consumer", "both")
KV_TRANSPORTS = ("tcp", "cuda_ipc", "nixl")


@dataclass
class KVTransferConfig:
    """Disaggregated prefill/decode: this engine's role and where it serves KV pulls.

    `producer`: a request with `do_remote_decode` keeps its prompt's blocks under a lease after
    its one token, and the engine serves pulls of them on `transfer_address`. `consumer`: a
    request with `do_remote_prefill` pulls the blocks it does not hold from the producer named
    in its parameters, only when that address is one of `producers` (or its own pull address,
    for `both`): a request never makes the engine connect anywhere else. `both`: either. `none`
    (default): transfer parameters are echoed only.

    `auth_tokens` and the `tls_*` paths are the engine service's own credentials (its
    `--auth-token`, `--tls-cert`, `--tls-key`, `--tls-client-ca`), filled by the service, not
    flags of their own; they guard the pull port (`kv_connector/auth.py`). The tokens never
    travel on a command line (the core process gets them through its environment).
    """

    role: str = _opt("none", "disaggregated prefill/decode role: producer keeps a prefill's KV under a lease "
                     "and serves pulls; consumer pulls it for the decode leg", flag="kv-role", choices=KV_ROLES)
    engine_id: str | None = _opt(None, "this engine's id in KV transfer parameters (default: random)",
                                 flag="kv-engine-id")
    transfer_address: str = _opt("127.0.0.1:0", "host:port where a producer serves KV pulls (port 0: pick one)",
                                 flag="kv-transfer-address")
    lease_seconds: float = _opt(30.0, "how long a producer keeps a prefill's blocks for the decode leg",
                                flag="kv-lease-seconds")
    max_leases: int = _opt(512, "most leases a producer holds at once, counting prefill legs that will make one; "
                           "a prefill leg past it gets RESOURCE_EXHAUSTED", flag="kv-max-leases")
    max_leases_per_caller: int = _opt(256, "most of those one caller may hold (callers are told apart by their "
                                      "token and client certificate; without auth all callers are one)",
                                      flag="kv-max-leases-per-caller")
    transport: str = _opt("tcp", "how a producer's blocks are pulled: tcp (any host, CPU or GPU), cuda_ipc "
                          "(two processes on one host's GPUs) or nixl (NIXL/UCX READs, needs nixl-cu13 on both "
                          "engines); the pull address carries the handshake", flag="kv-transport",
                          choices=KV_TRANSPORTS)
    producers: list[str] | None = _opt(None, "host:port of a producer this consumer may pull from (repeat the flag; "
                                       "host:* trusts every port of host, for development); pull addresses in "
                                       "requests name one of these or are refused", flag="kv-producer")
    tls_ca: str | None = _opt(None, "CA bundle (PEM) that signs the producers' certificates, for pulls over TLS "
                              "(default: --tls-client-ca, else the system's roots)", flag="kv-tls-ca")
    auth_tokens: tuple[str, ...] = field(default=(), repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None

    @property
    def is_producer(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("consumer", "both")

    @property
    def enabled(self) -> bool:
        return self.role != "none"

    def host_port(self) -> tuple[str, int]:
        host, sep, port = self.transfer_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"kv transfer address must be host:port, got {self.transfer_address!r}")
        return host, int(port)

    def trusts_producer(self, host: str, port: int, own: tuple[str, int] | None = None) -> bool:
        """Whether this consumer may connect to (host, port): one of `producers` (a `host:*`
        entry covers every port of host) or this engine's own pull address `own`."""
        if own is not None and (host, port) == own:
            return True
        for entry in self.producers or ():
            h, _, p = entry.rpartition(":")
            if h == host and (p == "*" or p == str(port)):
                return True
        return False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.role not in KV_ROLES:
            raise ValueError(f"kv role must be one of {', '.join(KV_ROLES)}, got {self.role!r}")
        if self.transport not in KV_TRANSPORTS:
            raise ValueError(f"kv transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.transport!r}")
        if not self.lease_seconds > 0:
            raise ValueError("kv lease seconds must be > 0")
        if self.max_leases < 1 or self.max_leases_per_caller < 1:
            raise ValueError("kv max leases (in total and per caller) must be >= 1")
        self.host_port()
        for entry in self.producers or ():
            host, sep, port = entry.rpartition(":")
            if not sep or not host or not (port == "*" or (port.isdigit() and 0 < int(port) < 65536)):
                raise ValueError(f"kv producer must be host:port or host:*, got {entry!r}")


@dataclass
class EngineConfig:
    """The engine's whole configuration: model, KV cache, scheduler, KV transfer (each part
    validated when built; `validate` checks them again after a caller changed a field)."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)

    @classmethod
    def default(cls, **model_kwargs) -> "EngineConfig":
        return cls(ModelConfig(**model_kwargs), CacheConfig(), SchedulerConfig())

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.kv_transfer.validate()
