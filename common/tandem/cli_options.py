"""The non-engine options of the `tandem` subcommands, declared once as dataclass fields.

`tandem.options` turns each field into a flag, a `TANDEM_*` environment variable and a
`--config` key (the engine's own fields live in `tandem/engine_service/config.py`). The servers'
option classes (`tandem/frontend/app.py` FrontendOptions, `engine_service/api/app.py`
EngineServerOptions) are subclasses of these, so a setting's default and help are written once
and the CLI builds the options with `tandem.options.from_args`. Where the engine's default
differs (it listens on 127.0.0.1:50052, the frontend on 0.0.0.0:50051), `EngineServerArgs`
redeclares only the default, keeping the field's flag metadata.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from tandem.options import host_port, non_negative_float, port_number, positive_float


def _opt(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


DEFAULT_FRONTEND_ADDRESS = "127.0.0.1:50051"
DEFAULT_ENGINE_ADDRESS = "127.0.0.1:50052"


@dataclass
class ServerArgs:
    """Listening address and request defaults of one gRPC service (engine or frontend)."""

    host: str = _opt("0.0.0.0", "bind address")
    port: int = _opt(50051, "port (0: any free port)", parse=port_number)
    default_max_tokens: int = _opt(256, "max_tokens of a request that sets none (unless the model's "
                                        "generation config gives max_new_tokens)")
    drain_timeout: float = _opt(30.0, "seconds in-flight requests may take to finish after SIGTERM or Ctrl-C",
                                parse=non_negative_float)
    enable_reflection: bool = _opt(False, "serve grpc.reflection")


def _redefault(cls, name: str, default):
    """Field `name` of dataclass `cls` with another default (same flag, help and metadata)."""
    return field(default=default, metadata=cls.__dataclass_fields__[name].metadata)


@dataclass
class EngineServerArgs(ServerArgs):
    """ServerArgs of the engine service: a private address, the port after the frontend's."""

    host: str = _redefault(ServerArgs, "host", "127.0.0.1")
    port: int = _redefault(ServerArgs, "port", 50052)
    served_model_name: str | None = _opt(None, "the model's name in metric labels (model_name), as the frontend "
                                               "serves it (default: --model)")


@dataclass
class FrontendServingArgs:
    """What a frontend process reads to serve: tokenizer, model name, engine transport."""

    tokenizer: str | None = _opt(None, "model directory with the tokenizer (default: the engine's)")
    served_model_name: str | None = _opt(None, "model name clients may ask for (default: the engine's --model)")
    engine_transport: str = _opt("stream", "frontend-engine transport: a Stream call per choice, or one "
                                           "multiplexed stream per engine (the faster one at high concurrency; "
                                           "tandem serve's default)",
                                 choices=("stream", "mux"))
    http_port: int | None = _opt(None, "serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                                       "/v1/models, /tokenize, /detokenize, /health) on this port of --host, with "
                                       "the gRPC port's TLS and tokens; off when not given (0: any free port)",
                                 parse=port_number)
    trust_kv_callers: bool = _opt(False, "callers may send KV transfer parameters and see the ones engines return "
                                         "(pull address, lease, its secret, block ids): only for a router on a "
                                         "private network; off, such parameters are refused (PERMISSION_DENIED) "
                                         "and replies carry their extra fields only")


@dataclass
class FrontendArgs(FrontendServingArgs):
    """What `tandem frontend` resolves before it starts one: its engines (or two pools), its
    worker count and how long it waits for the engines to accept connections."""

    engine: list[str] | None = _opt(None, "engine address, or dns:///NAME:PORT for every address NAME resolves "
                                          "to, followed as it changes (--engine-resolve-interval); repeat for "
                                          "replicas (default: 127.0.0.1:50052)", metavar="HOST:PORT", parse=host_port)
    prefill_engine: list[str] | None = _opt(None, "disaggregated prefill/decode: a prefill engine (--kv-role "
                                                  "producer or both); repeat for a pool. With --decode-engine, "
                                                  "every request runs a prefill leg here and a decode leg there "
                                                  "(replaces --engine)", metavar="HOST:PORT", parse=host_port)
    decode_engine: list[str] | None = _opt(None, "disaggregated prefill/decode: a decode engine (--kv-role "
                                                 "consumer or both); repeat for a pool; needs --prefill-engine",
                                           metavar="HOST:PORT", parse=host_port)
    engine_resolve_interval: float = _opt(5.0, "seconds between lookups of dns:/// engine names: addresses that "
                                               "appear are added, vanished ones drained", parse=positive_float)
    workers: int = _opt(1, "frontend processes sharing the port (SO_REUSEPORT); metrics ports count up "
                           "from --metrics-port")
    engine_connect_timeout: float = _opt(30.0, "seconds to wait for each --engine address to accept "
                                               "connections before giving up at start; 0: no check, wait "
                                               "for the engines while answering health (orchestrators)",
                                         parse=non_negative_float)


def auto_frontend_workers(cpu_count: int | None = None) -> int:
    """`--frontend-workers auto`: one frontend process per 4 cores, 1 to 4 (the engine service's
    gRPC process and its core process need cores of their own)."""
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(4, cores // 4))


def workers_count(text: str | int) -> int:
    """A worker count flag's value: a positive integer or `auto`."""
    if text == "auto":
        return auto_frontend_workers()
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}")
    return value


@dataclass
class EngineCoreArgs:
    """Where the engine core (scheduler, model runner, sampler loop) runs."""

    engine_core: str = _opt("process", "where the engine core runs: its own process, talking to the gRPC "
                                       "server over ZeroMQ IPC, or a thread of the gRPC server's process",
                            choices=("process", "thread"))


@dataclass
class ServeArgs:
    """`tandem serve` only: where its engine child listens, and the frontend's worker count."""

    engine_host: str = _opt("127.0.0.1", "engine bind address (private by default)")
    engine_port: int = _opt(50052, "engine port (0: any free port)", parse=port_number)
    frontend_workers: int = _opt("auto", "frontend processes sharing the port (SO_REUSEPORT); metrics ports "
                                         "count up from --metrics-port; auto: one per 4 cores, 1 to 4",
                                 parse=workers_count)
    engine_metrics_port: int | None = _opt(None, "serve the engine child's Prometheus metrics on this port; "
                                                 "off when not given", parse=port_number)
    disaggregated: bool = _opt(False, "start two engine children, a prefill engine (--kv-role producer, on "
                                      "--engine-port) and a decode engine (--kv-role consumer, on "
                                      "--decode-engine-port), and run every request in two legs")
    decode_engine_port: int | None = _opt(None, "--disaggregated: the decode engine's port (default: "
                                                "--engine-port + 1)", parse=port_number)


@dataclass
class MetricsArgs:
    """The Prometheus endpoint of one process."""

    metrics_host: str | None = _opt(None, "Prometheus endpoint bind address (default: the service's own --host; the engine child's: --engine-host)")
    metrics_port: int | None = _opt(None, "serve Prometheus metrics on this port; off when not given",
                                    parse=port_number)


@dataclass
class EngineMetricsArgs:
    """How an engine names its Prometheus metrics (`tandem engine`, and `serve`'s engine child)."""

    metrics_names: str = _opt("tandem", "engine metric names: tandem:* only, or vllm: also the vLLM-named families "
                                        "gateways and dashboards read (vllm:num_requests_waiting, "
                                        "vllm:kv_cache_usage_perc, ...) as aliases", choices=("tandem", "vllm"))


def otlp_endpoint(text: str) -> str:
    """An `--otlp-endpoint` value (`tandem.tracing.check_otlp_endpoint`)."""
    from tandem.tracing import check_otlp_endpoint

    try:
        return check_otlp_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass
class TracingArgs:
    """OpenTelemetry spans of one process (`tandem.tracing`): where they go and the service name
    they carry. `serve` passes both on to its engine children, the name as NAME-engine."""

    otlp_endpoint: str | None = _opt(None, "send OpenTelemetry spans over OTLP/gRPC to this collector, "
                                           "http://HOST:PORT (plaintext) or https://HOST:PORT (TLS); off when "
                                           "not given (no tracer: nothing recorded, client trace context "
                                           "passed on as it came)", metavar="URL", parse=otlp_endpoint)
    otlp_service_name: str | None = _opt(None, "service.name of this process's spans (default: tandem-frontend "
                                               "for a frontend, tandem-engine for an engine; serve's engine "
                                               "children get NAME-engine)", metavar="NAME")

    def service_name(self, role: str) -> str:
        """The service.name of a process in `role` (`frontend` or `engine`)."""
        return self.otlp_service_name or f"tandem-{role}"


@dataclass
class ClientArgs:
    """`tandem generate` / `tandem chat`: where the server is, how long to wait, what to ask for."""

    address: str = _opt(DEFAULT_FRONTEND_ADDRESS, "frontend address", metavar="HOST:PORT", parse=host_port)
    wait: float = _opt(300.0, "seconds to wait for the server to become ready (the embedded model's first "
                              "start converts it); a server that does not answer at all is given at most "
                              "30 of them", parse=non_negative_float)
    max_tokens: int | None = _opt(None, "most tokens to generate (default: the server's)")
    temperature: float | None = _opt(None, "sampling temperature, 0 = greedy (default: the model's)")
    top_p: float | None = _opt(None, "nucleus sampling threshold (default: the model's)")
    top_k: int | None = _opt(None, "sample among the k most likely tokens (default: the model's)")
    seed: int | None = _opt(None, "sampling seed (default: random)")
    stop: list[str] | None = _opt(None, "stop string; repeat for several")
    n: int | None = _opt(None, "choices to generate")
    logprobs: int | None = _opt(None, "log-probabilities of the top N alternatives per token")
    json: bool = _opt(False, "print the whole response as JSON")

    def sampling_kwargs(self) -> dict:
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, stop=self.stop or None, n=self.n, logprobs=self.logprobs)
