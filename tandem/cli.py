"""The `tandem` command: serve, engine, frontend, generate, chat, bench."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading

DEFAULT_MODEL = "smollm2-135m-instruct"


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=os.environ.get("TANDEM_MODEL", DEFAULT_MODEL),
                   help="embedded name, Hugging Face directory, .gguf file, or dummy:<config> (default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV pool size (blocks)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.9, help="GPU: fraction of free memory for KV")
    g.add_argument("--cpu-kv-cache-gb", type=float, default=1.0, help="CPU: KV pool size in GiB")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-prefill-tokens-per-seq", type=int, default=None,
                   help="fair prefill: prompt tokens of one request per step, so a long prompt cannot hold up "
                        "others; 0: no cap (default: 512 on CUDA, 16 on CPU)")
    g.add_argument("--max-waiting-requests", type=int, default=1024, help="bound of the waiting queue (requests)")
    g.add_argument("--max-waiting-tokens", type=int, default=1 << 20, help="bound of the waiting queue (prompt tokens)")
    g.add_argument("--cache-dir", default=None, help="where converted GGUF models are kept")
    g.add_argument("--seed", type=int, default=0, help="seed of dummy weights")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: Triton kernels on CUDA, PyTorch reference on CPU (default: %(default)s)")
    g.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs for decode")
    g.add_argument("--overlap-scheduling", default="auto", choices=["auto", "on", "off"],
                   help="build and launch the next step while the current one runs on the device; "
                        "auto: on for CUDA (default: %(default)s)")


def _engine_config(args):
    from tandem.engine_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                          seed=args.seed, cache_dir=args.cache_dir, attention_backend=args.attention_backend,
                          enforce_eager=args.enforce_eager),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks,
                          memory_fraction=args.kv_cache_memory_fraction,
                          cpu_kv_cache_bytes=int(args.cpu_kv_cache_gb * (1 << 30)),
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_waiting_requests=args.max_waiting_requests,
                                  max_waiting_tokens=args.max_waiting_tokens,
                                  max_prefill_tokens_per_seq=args.max_prefill_tokens_per_seq,
                                  overlap_scheduling=args.overlap_scheduling),
    )


def _engine_flags(args) -> list[str]:
    """The engine flags of `serve`, passed on to the engine subprocess."""
    out = ["--model", args.model, "--dtype", args.dtype, "--device", args.device, "--block-size", str(args.block_size),
           "--kv-cache-memory-fraction", str(args.kv_cache_memory_fraction), "--cpu-kv-cache-gb", str(args.cpu_kv_cache_gb),
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-waiting-requests", str(args.max_waiting_requests), "--max-waiting-tokens", str(args.max_waiting_tokens),
           "--seed", str(args.seed), "--attention-backend", args.attention_backend,
           "--overlap-scheduling", args.overlap_scheduling]
    for flag, value in (("--max-model-len", args.max_model_len), ("--num-kv-blocks", args.num_kv_blocks),
                        ("--cache-dir", args.cache_dir),
                        ("--max-prefill-tokens-per-seq", args.max_prefill_tokens_per_seq)):
        if value is not None:
            out += [flag, str(value)]
    if args.no_prefix_caching:
        out.append("--no-prefix-caching")
    if args.enforce_eager:
        out.append("--enforce-eager")
    return out


def _security(args, prefix: str = ""):
    """The SecurityOptions of one hop (flags from `add_security_args`); a bad combination exits."""
    from tandem.security import SecurityConfigError, SecurityOptions

    try:
        return SecurityOptions.from_args(args, prefix)
    except SecurityConfigError as exc:
        raise SystemExit(f"tandem: {exc}") from None


def _metrics_args(p: argparse.ArgumentParser, engine_child: bool = False) -> None:
    g = p.add_argument_group("metrics")
    g.add_argument("--metrics-host", default="0.0.0.0", help="Prometheus endpoint bind address (default: %(default)s)")
    g.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port" + (" (the frontend's)" if engine_child else "")
                   + "; off when not given")
    if engine_child:
        g.add_argument("--engine-metrics-port", type=int, default=None,
                       help="serve the engine child's Prometheus metrics on this port; off when not given")


def _metrics_options(args) -> dict:
    return {"metrics_host": args.metrics_host, "metrics_port": args.metrics_port}


def _engine_metrics_argv(args) -> list[str]:
    """`serve`: the engine child's metrics flags (its own port, the shared bind address)."""
    if args.engine_metrics_port is None:
        return []
    if args.engine_metrics_port == args.metrics_port and args.metrics_port != 0:
        raise SystemExit("tandem: --metrics-port and --engine-metrics-port must differ (two processes)")
    return ["--metrics-host", args.metrics_host, "--metrics-port", str(args.engine_metrics_port)]


def _fault_after_steps() -> int | None:
    """Testing only: TANDEM_FAULT_AFTER_STEPS=N makes the engine loop fail after N steps."""
    value = os.environ.get("TANDEM_FAULT_AFTER_STEPS")
    return int(value) if value else None


def cmd_engine(args) -> int:
    from tandem.engine_service.app import EngineServerOptions, run_engine

    return run_engine(_engine_config(args), EngineServerOptions(host=args.host, port=args.port,
                                                                default_max_tokens=args.default_max_tokens,
                                                                drain_timeout=args.drain_timeout,
                                                                security=_security(args), reflection=args.enable_reflection,
                                                                fail_after_steps=_fault_after_steps(),
                                                                **_metrics_options(args)))


def cmd_frontend(args) -> int:
    from tandem.frontend.app import FrontendOptions
    from tandem.frontend.workers import run_frontend_workers

    return run_frontend_workers(FrontendOptions(host=args.host, port=args.port, engines=args.engine,
                                        tokenizer_path=args.tokenizer, served_model_name=args.served_model_name,
                                        default_max_tokens=args.default_max_tokens, drain_timeout=args.drain_timeout,
                                        security=_security(args), engine_security=_security(args, "engine-"),
                                        reflection=args.enable_reflection, engine_transport=args.engine_transport,
                                        **_metrics_options(args)),
                                args.workers, args.log_level, args.log_format == "json")


def cmd_serve(args) -> int:
    """Engine in a child process, frontend in this one; either ending ends both."""
    from tandem.frontend.app import FrontendOptions
    from tandem.frontend.workers import run_frontend_workers
    from tandem.security import engine_child_security

    engine_addr = f"{args.engine_host}:{args.engine_port}"
    security, engine_security = _security(args), _security(args, "engine-")
    # The engine child gets the server side of the engine hop; its token travels in the env.
    child_security_argv, child_env = engine_child_security(engine_security)
    child = subprocess.Popen(
        [sys.executable, "-P", "-m", "tandem.cli", "--log-level", args.log_level, "--log-format", args.log_format,
         "engine", "--host", args.engine_host, "--port", str(args.engine_port),
         "--default-max-tokens", str(args.default_max_tokens), "--drain-timeout", str(args.drain_timeout)]
        + _engine_flags(args) + child_security_argv + _engine_metrics_argv(args)
        + (["--enable-reflection"] if args.enable_reflection else []),
        env={**os.environ, **child_env},
    )

    stopping = threading.Event()

    def stop_during_startup(signum, frame):
        # Until the frontend's event loop installs its own handlers (which drain), a signal
        # must still take the engine child down with us.
        stopping.set()
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
        raise SystemExit(0)

    def watch_engine():
        child.wait()
        if not stopping.is_set():  # the engine died on its own: end the frontend too
            log_exit = f"engine exited with code {child.returncode}"
            sys.stderr.write(json.dumps({"event": "engine_child_exited", "detail": log_exit}) + "\n")
            os.kill(os.getpid(), signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_during_startup)
    threading.Thread(target=watch_engine, name="engine-watch", daemon=True).start()
    try:
        rc = run_frontend_workers(
            FrontendOptions(host=args.host, port=args.port, engines=[engine_addr],
                            served_model_name=args.served_model_name, tokenizer_path=args.tokenizer,
                            default_max_tokens=args.default_max_tokens, drain_timeout=args.drain_timeout,
                            security=security, engine_security=engine_security,
                            reflection=args.enable_reflection, engine_transport=args.engine_transport,
                            **_metrics_options(args)),
            args.frontend_workers, args.log_level, args.log_format == "json")
    finally:
        stopping.set()
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(args.drain_timeout + 10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    return rc or (child.returncode or 0)


def _print_response(resp, as_json: bool) -> None:
    if as_json:
        from google.protobuf import json_format

        print(json_format.MessageToJson(resp))
        return
    for c in resp.choices:
        prefix = f"[{c.index}] " if len(resp.choices) > 1 else ""
        print(prefix + c.text)


def _client_kwargs(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed, stop=args.stop or None, n=args.n, logprobs=args.logprobs)


def cmd_generate(args) -> int:
    from tandem.client import TandemClient

    with TandemClient(args.address, security=_security(args)) as client:
        if args.stream:
            for msg in client.stream(args.prompt, **_client_kwargs(args)):
                for c in msg.choices:
                    sys.stdout.write(c.text)
                sys.stdout.flush()
            print()
        else:
            _print_response(client.generate(args.prompt, **_client_kwargs(args)), args.json)
    return 0


def cmd_chat(args) -> int:
    from tandem.client import TandemClient

    messages = [{"role": "system", "content": args.system}] if args.system else []
    with TandemClient(args.address, security=_security(args)) as client:
        if args.message:
            messages.append({"role": "user", "content": args.message})
            _print_response(client.chat(messages, **_client_kwargs(args)), args.json)
            return 0
        while True:  # interactive
            try:
                line = input("you> ")
            except EOFError:
                return 0
            messages.append({"role": "user", "content": line})
            reply = client.chat(messages, **_client_kwargs(args)).choices[0].text
            print(f"model> {reply}")
            messages.append({"role": "assistant", "content": reply})


def _client_args(p: argparse.ArgumentParser) -> None:
    from tandem.security import add_security_args

    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append")
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print the whole response as JSON")
    add_security_args(p, server=False, client=True)


def build_parser() -> argparse.ArgumentParser:
    from tandem.security import add_security_args

    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("TANDEM_LOG_LEVEL", "info"))
    parser.add_argument("--log-format", default=os.environ.get("TANDEM_LOG_FORMAT", "json"), choices=["json", "console"])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="engine + frontend together")
    serve.add_argument("--frontend-workers", type=int, default=1,
                        help="frontend processes sharing the port (SO_REUSEPORT); metrics ports count up from --metrics-port")
    serve.add_argument("--engine-transport", choices=["stream", "mux"], default="stream",
                        help="frontend-engine transport: a Stream call per choice, or one multiplexed stream per engine")
    serve.add_argument("--enable-reflection", action="store_true", help="serve grpc.reflection (off by default)")
    _engine_args(serve)
    serve.add_argument("--host", default="0.0.0.0", help="frontend bind address")
    serve.add_argument("--port", type=int, default=50051, help="frontend port")
    serve.add_argument("--engine-host", default="127.0.0.1", help="engine bind address (private by default)")
    serve.add_argument("--engine-port", type=int, default=50052)
    serve.add_argument("--tokenizer", default=None)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--default-max-tokens", type=int, default=256)
    serve.add_argument("--drain-timeout", type=float, default=30.0)
    add_security_args(serve)  # clients → frontend
    add_security_args(serve, "engine-", server=True, client=True)  # frontend → engine child, both ends
    _metrics_args(serve, engine_child=True)
    serve.set_defaults(fn=cmd_serve)

    engine = sub.add_parser("engine", help="the engine service alone")
    engine.add_argument("--enable-reflection", action="store_true", help="serve grpc.reflection (off by default)")
    _engine_args(engine)
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--port", type=int, default=50052)
    engine.add_argument("--default-max-tokens", type=int, default=256)
    engine.add_argument("--drain-timeout", type=float, default=30.0)
    add_security_args(engine)
    _metrics_args(engine)
    engine.set_defaults(fn=cmd_engine)

    front = sub.add_parser("frontend", help="the frontend alone, in front of one or more engines")
    front.add_argument("--workers", type=int, default=1,
                        help="frontend processes sharing the port (SO_REUSEPORT); metrics ports count up from --metrics-port")
    front.add_argument("--engine-transport", choices=["stream", "mux"], default="stream",
                        help="frontend-engine transport: a Stream call per choice, or one multiplexed stream per engine")
    front.add_argument("--enable-reflection", action="store_true", help="serve grpc.reflection (off by default)")
    front.add_argument("--host", default="0.0.0.0")
    front.add_argument("--port", type=int, default=50051)
    front.add_argument("--engine", action="append", default=None, help="engine address; repeat for replicas")
    front.add_argument("--tokenizer", default=None, help="model directory with the tokenizer (default: the engine's)")
    front.add_argument("--served-model-name", default=None)
    front.add_argument("--default-max-tokens", type=int, default=256)
    front.add_argument("--drain-timeout", type=float, default=30.0)
    add_security_args(front)  # clients → frontend
    add_security_args(front, "engine-", server=False, client=True)  # frontend → engines
    _metrics_args(front)
    front.set_defaults(fn=cmd_frontend)

    gen = sub.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--stream", action="store_true")
    _client_args(gen)
    gen.set_defaults(fn=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the served model (interactive without a message)")
    chat.add_argument("message", nargs="?")
    chat.add_argument("--system", default=None)
    _client_args(chat)
    chat.set_defaults(fn=cmd_chat)

    from tandem.bench.cli import add_bench_parser

    add_bench_parser(sub)  # tandem bench roofline|throughput|serve|report
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "frontend" and not args.engine:
        args.engine = ["127.0.0.1:50052"]
    from tandem.logging_setup import configure_logging

    configure_logging(args.log_level, json=args.log_format == "json")
    return args.fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
