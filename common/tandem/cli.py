"""The `tandem` command: serve, engine, frontend, generate, chat, bench, plan.

Flags come from dataclasses (`tandem/engine_service/config.py`, `tandem/cli_options.py`) through
`tandem.options`: every flag has a help line with its default, a `TANDEM_<FLAG>` environment
variable and a `--config FILE` key; precedence: command line > environment > config file >
default. A server command checks its flags before it starts (`tandem.startup_checks`) and a
client command waits for the server to be ready (`tandem.readiness`); either failure is one
line on stderr (one JSON record with `--log-format json`) and a non-zero exit. Tracebacks
appear only with `--log-level debug`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading

from tandem import options
from tandem.cli_options import (
    DEFAULT_ENGINE_ADDRESS,
    ClientArgs,
    EngineCoreArgs,
    EngineMetricsArgs,
    EngineServerArgs,
    FrontendArgs,
    FrontendServingArgs,
    MetricsArgs,
    ServeArgs,
    ServerArgs,
    TracingArgs,
)
from tandem.startup_checks import StartupError

# The engine distribution is optional for the frontend and client commands: nothing here imports
# it at module level, and `serve`, `engine` and `bench` are offered only where it is installed.
ENGINE_PACKAGE = "tandem.engine_service"
# Set by `serve` in its engine children's environment: the pid they stop with.
SERVE_PARENT_ENV = "TANDEM_SERVE_PARENT_PID"


# -- engine flags (their declaration: tandem/engine_service/config.py; tests call these two) --------------


def _engine_config(args):
    from tandem.engine_service.config_flags import engine_config_from_args

    return engine_config_from_args(args)


def _engine_flags(args) -> list[str]:
    """The engine flags of `serve`, passed on to the engine subprocess."""
    return options.engine_argv(_engine_config(args))


def _security(args, prefix: str = ""):
    """The SecurityOptions of one hop (flags from `add_security_args`); a bad combination exits."""
    from tandem.security import SecurityConfigError, SecurityOptions

    try:
        return SecurityOptions.from_args(args, prefix)
    except SecurityConfigError as exc:
        message = str(exc) if str(exc).startswith("-") else f"--{prefix}{exc}"
        raise StartupError(message.split()[0], None, message) from None


def _metrics_options(args) -> dict:
    """The metrics endpoint's bind address: --metrics-host, else the service's own --host."""
    return {"metrics_host": args.metrics_host or args.host}


def _engine_metrics_argv(args, offset: int = 0) -> list[str]:
    """`serve`: the engine child's metrics flags (its own port, the shared bind address); the
    second engine of `--disaggregated` uses the port `offset` above."""
    if args.engine_metrics_port is None:
        return []
    if offset:
        port = args.engine_metrics_port + offset if args.engine_metrics_port else 0
        return ["--metrics-host", args.metrics_host or args.engine_host, "--metrics-port", str(port)]
    if args.engine_metrics_port == args.metrics_port and args.metrics_port != 0:
        raise StartupError("--engine-metrics-port", args.engine_metrics_port,
                           "must differ from --metrics-port (two processes)")
    return ["--metrics-host", args.metrics_host or args.engine_host, "--metrics-port", str(args.engine_metrics_port)]


def _engine_metrics_naming_argv(args) -> list[str]:
    """`serve`: how its engine children name their metrics (vLLM aliases, the served name)."""
    argv = ["--metrics-names", args.metrics_names]
    if args.served_model_name:
        argv += ["--served-model-name", args.served_model_name]
    return argv


def _engine_tracing_argv(args) -> list[str]:
    """`serve`: its engine children's tracing flags (the frontend's collector; NAME-engine as
    their service name when `--otlp-service-name NAME` is given)."""
    argv = ["--otlp-endpoint", args.otlp_endpoint] if args.otlp_endpoint else []
    if args.otlp_service_name:
        argv += ["--otlp-service-name", f"{args.otlp_service_name}-engine"]
    return argv


def _fault_after_steps() -> int | None:
    """Testing only: TANDEM_FAULT_AFTER_STEPS=N makes the engine loop fail after N steps."""
    value = os.environ.get("TANDEM_FAULT_AFTER_STEPS")
    return int(value) if value else None


def _connect_host(host: str) -> str:
    """The address a local client dials for a server bound to `host`."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)


# -- server commands ------------------------------------------------------------------------------


def _resolve_zero_ports(args, ports) -> None:
    """Port flags given as 0 become a free port now, before any process starts: the frontend
    dials its engine child at the resolved port, workers sharing a port share the same one, and
    the ready line names the port clients can use."""
    from tandem import startup_checks

    for dest, host in ports:
        if getattr(args, dest, None) == 0:
            setattr(args, dest, startup_checks.free_port(host))


def _resolve_serve_ports(args) -> None:
    """`serve`'s port flags given as 0 (the decode engine's too, when its default would be the
    next port up from an engine port not yet picked)."""
    if args.disaggregated and args.engine_port == 0 and args.decode_engine_port is None:
        args.decode_engine_port = 0
    _resolve_zero_ports(args, (("port", args.host), ("engine_port", args.engine_host),
                               ("decode_engine_port", args.engine_host), ("http_port", args.host)))


def _check_engine_flags(args) -> None:
    from tandem import startup_checks

    startup_checks.check_model(args.model)
    startup_checks.check_generation_config(args.generation_config)
    try:
        _engine_config(args)  # the configs validate themselves as they are built
    except options.FlagValueError as exc:
        raise StartupError(exc.flag, exc.value, exc.reason) from None
    except ValueError as exc:
        raise StartupError("engine flags", None, str(exc)) from None


def cmd_engine(args) -> int:
    from tandem import startup_checks

    _die_with_serve_parent()
    _check_engine_flags(args)
    startup_checks.check_port_free("--port", args.host, args.port)
    startup_checks.check_port_free("--metrics-port", args.metrics_host or args.host, args.metrics_port)
    startup_checks.check_pem_files(args)
    from tandem.engine_service.api.app import EngineServerOptions, run_engine

    return run_engine(_engine_config(args), options.from_args(
        EngineServerOptions, args, security=_security(args), fail_after_steps=_fault_after_steps(),
        log_level=args.log_level, log_format=args.log_format, **_metrics_options(args)))


def _frontend_options(args, engines: list[str], prefill: list[str] | None = None, decode: list[str] | None = None):
    from tandem.frontend.app import FrontendOptions

    return options.from_args(FrontendOptions, args, engines=engines, prefill_engines=list(prefill or []),
                             decode_engines=list(decode or []), security=_security(args),
                             engine_resolve_interval=getattr(args, "engine_resolve_interval",
                                                             FrontendOptions.engine_resolve_interval),
                             engine_security=_security(args, "engine-"), **_metrics_options(args))


def _disaggregated_engines(args) -> tuple[list[str], list[str]]:
    """`--prefill-engine` / `--decode-engine`: both or neither, and not with `--engine`."""
    prefill, decode = args.prefill_engine or [], args.decode_engine or []
    if bool(prefill) != bool(decode):
        missing = "--decode-engine" if prefill else "--prefill-engine"
        raise StartupError(missing, None, f"{missing} is needed too: disaggregated prefill/decode takes a "
                                          "prefill pool and a decode pool")
    if prefill and args.engine:
        raise StartupError("--engine", None, "--engine cannot be combined with --prefill-engine/--decode-engine "
                                             "(the two pools replace it)")
    return prefill, decode


def _tokenizer_dir(args) -> str | None:
    """`--tokenizer` (checked) as the directory the frontend loads: any `--model` form is
    resolved here, once, so the frontend never reaches for the Hub with it."""
    if args.tokenizer is None:
        return None
    from tandem.model_spec import ModelSpecError, resolve_tokenizer_spec

    try:
        return resolve_tokenizer_spec(args.tokenizer, getattr(args, "cache_dir", None))
    except (ModelSpecError, OSError, ValueError) as exc:
        raise StartupError("--tokenizer", args.tokenizer, str(exc).splitlines()[0]) from None


def cmd_frontend(args) -> int:
    from tandem import startup_checks

    prefill, decode = _disaggregated_engines(args)
    engines = prefill + decode if prefill else (args.engine or [DEFAULT_ENGINE_ADDRESS])
    if args.workers > 1:
        _resolve_zero_ports(args, (("port", args.host), ("http_port", args.host)))
    startup_checks.check_port_free("--port", args.host, args.port)
    startup_checks.check_port_free("--metrics-port", args.metrics_host or args.host, args.metrics_port)
    startup_checks.check_port_free("--http-port", args.host, args.http_port)
    startup_checks.check_pem_files(args)
    startup_checks.check_pem_files(args, "engine-")
    startup_checks.check_tokenizer(args.tokenizer)
    startup_checks.check_engines_reachable(engines, args.engine_connect_timeout)
    args.tokenizer = _tokenizer_dir(args)
    from tandem.frontend.workers import run_frontend_workers

    return run_frontend_workers(_frontend_options(args, engines, prefill, decode), args.workers, args.log_level,
                                args.log_format == "json")


def _child_env(parser_for_engine: argparse.ArgumentParser) -> dict[str, str]:
    """The environment of `serve`'s engine child: the parent passes every engine flag on the
    command line, so `TANDEM_<FLAG>` variables meant for the parent (its `--port`, its
    certificate) must not become the child's defaults."""
    names = {options.env_name(a) for a in options.flag_actions(parser_for_engine)} - {None}
    names.discard("TANDEM_CACHE_DIR")  # also read by the loader, with the same meaning
    return {k: v for k, v in os.environ.items() if k not in names}


def _kv_producer_address(args) -> str:
    """`serve --disaggregated`: where the prefill engine serves KV pulls: --kv-transfer-address
    when one was given with a port, else a free port of --engine-host, picked now so that the
    decode engine can be told to trust exactly that address (`--kv-producer`)."""
    import socket

    from tandem.engine_service.config import KVTransferConfig

    given = args.transfer_address
    if given == KVTransferConfig.transfer_address:
        given = f"{args.engine_host}:0"
    host, _, port = given.rpartition(":")
    if port != "0":
        return given
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host.strip("[]"), 0))
        return f"{host}:{probe.getsockname()[1]}"


def _kv_role_argv(args, role: str, producer_address: str) -> list[str]:
    """`serve --disaggregated`: an engine child's KV role, after the shared engine flags (the
    later flag wins). The producer serves pulls on `producer_address`; the consumer trusts it
    (`--kv-producer`); a given --kv-engine-id gets the role as a suffix."""
    argv = ["--kv-role", role]
    if role == "producer":
        argv += ["--kv-transfer-address", producer_address]
    else:
        argv += ["--kv-producer", producer_address]
    if args.engine_id:
        argv += ["--kv-engine-id", f"{args.engine_id}-{'prefill' if role == 'producer' else 'decode'}"]
    return argv


def _invoked_as() -> str:
    """How the user ran this command, for lines that suggest another one: `tandem` when that
    is on PATH as this very script, else the path they typed (`.venv/bin/tandem`)."""
    import shutil

    typed = sys.argv[0] if sys.argv and os.path.basename(sys.argv[0]) == "tandem" else ""
    if not typed:
        return "tandem"
    on_path = shutil.which("tandem")
    if on_path and os.path.realpath(on_path) == os.path.realpath(typed):
        return "tandem"
    return typed


def _die_with_serve_parent() -> None:
    """An engine child of `serve` (SERVE_PARENT_ENV names its pid) gets SIGTERM when `serve`
    dies (Linux), since its own process group no longer shares the terminal's signals."""
    parent = os.environ.pop(SERVE_PARENT_ENV, None)
    if not parent:
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # serve died before the prctl: nothing would signal us
        os.kill(os.getpid(), signal.SIGTERM)


def cmd_serve(args) -> int:
    """Engine in a child process (two with --disaggregated: a prefill and a decode engine),
    frontend in this one; any of them ending ends all."""
    import multiprocessing

    from tandem import startup_checks

    _check_engine_flags(args)
    _resolve_serve_ports(args)
    decode_port = None
    if args.disaggregated:
        decode_port = args.decode_engine_port if args.decode_engine_port is not None else args.engine_port + 1
        if decode_port == args.engine_port:
            raise StartupError("--decode-engine-port", decode_port, "must differ from --engine-port (two engines)")
    startup_checks.check_port_free("--port", args.host, args.port)
    startup_checks.check_port_free("--engine-port", args.engine_host, args.engine_port)
    if decode_port is not None:
        startup_checks.check_port_free("--decode-engine-port", args.engine_host, decode_port)
    startup_checks.check_port_free("--metrics-port", args.metrics_host or args.host, args.metrics_port)
    startup_checks.check_port_free("--http-port", args.host, args.http_port)
    startup_checks.check_port_free("--engine-metrics-port", args.metrics_host or args.engine_host, args.engine_metrics_port)
    startup_checks.check_pem_files(args)
    startup_checks.check_pem_files(args, "engine-")
    startup_checks.check_tokenizer(args.tokenizer)
    args.tokenizer = _tokenizer_dir(args)
    # Imported after the checks: a wrong flag is reported before torch loads.
    from tandem.frontend.workers import run_frontend_workers
    from tandem.security import engine_child_security

    engine_addr = f"{args.engine_host}:{args.engine_port}"
    if decode_port is not None:
        decode_addr = f"{args.engine_host}:{decode_port}"
        frontend_options = _frontend_options(args, [engine_addr, decode_addr], [engine_addr], [decode_addr])
        # The decode engine's metrics (if asked) on the next port up.
        kv_address = _kv_producer_address(args)
        engines = [(args.engine_port, _kv_role_argv(args, "producer", kv_address), _engine_metrics_argv(args)),
                   (decode_port, _kv_role_argv(args, "consumer", kv_address), _engine_metrics_argv(args, offset=1))]
    else:
        frontend_options = _frontend_options(args, [engine_addr])
        engines = [(args.engine_port, [], _engine_metrics_argv(args))]
    engine_security = frontend_options.engine_security
    # The engine child gets the server side of the engine hop; its token travels in the env.
    child_security_argv, child_env = engine_child_security(engine_security)
    children = [subprocess.Popen(
        [sys.executable, "-P", "-m", "tandem.cli", "--log-level", args.log_level, "--log-format", args.log_format,
         "engine", "--host", args.engine_host, "--port", str(port),
         "--default-max-tokens", str(frontend_options.default_max_tokens),
         "--drain-timeout", str(frontend_options.drain_timeout)]
        + _engine_flags(args) + role_argv + ["--engine-core", args.engine_core] + child_security_argv
        + metrics_argv + _engine_metrics_naming_argv(args) + _engine_tracing_argv(args)
        + (["--enable-reflection"] if frontend_options.enable_reflection else []),
        env={**_child_env(args.engine_parser), **child_env, SERVE_PARENT_ENV: str(os.getpid())},
        # Their own process group: a terminal's Ctrl-C reaches this process alone, which drains
        # the frontend first and then stops the engines (with their requests already finished).
        process_group=0,
    ) for port, role_argv, metrics_argv in engines]

    stopping = threading.Event()
    ready = threading.Event()
    engine_died = threading.Event()  # on its own, not stopped by us
    died_code: list[int] = []

    def stop_children(timeout: float) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()

    def end_during_startup(code: int, line: str | None) -> None:
        # Nothing to drain before the frontend is ready: stop the children and the extra frontend
        # workers this process started, and leave without the event loop's teardown noise.
        stopping.set()
        stop_children(15)
        for worker in multiprocessing.active_children():
            worker.kill()
        if line:
            _report_line(args, line)
        sys.stderr.flush()
        os._exit(code)

    def draining() -> None:  # the first Ctrl-C/SIGTERM: an engine exiting now is expected
        stopping.set()

    def stop_at_once() -> None:  # the second: the engines are cut off with the frontend
        stopping.set()
        for child in children:
            if child.poll() is None:
                child.kill()

    def stop_during_startup(signum, frame):
        end_during_startup(128 + signum if signum != signal.SIGTERM else 0, None)

    def watch_engine(child: subprocess.Popen, name: str):
        child.wait()
        if stopping.is_set():
            return
        line = f"the {name} exited with code {child.returncode}"
        if not ready.is_set():
            end_during_startup(child.returncode or 1, line + " before it was ready (its log is above)")
        if engine_died.is_set():
            return
        died_code.append(child.returncode)
        engine_died.set()
        _report_line(args, line)  # an engine died on its own: end the frontend too
        os.kill(os.getpid(), signal.SIGTERM)

    def announce_ready():
        ready.set()
        address = f"{_connect_host(args.host)}:{args.port}"
        shape = (f" (disaggregated: prefill engine {engine_addr}, decode engine {decode_addr})"
                 if decode_port is not None else "")
        scheme = "https" if frontend_options.security.server_tls else "http"
        http = (f"; OpenAI HTTP at {scheme}://{_connect_host(args.host)}:{args.http_port}/v1"
                if args.http_port is not None else "")
        print(f"Tandem is ready: {args.served_model_name or args.model} at {address}{shape}{http} "
              f"(try: {_invoked_as()} chat --address {address} \"Hello\")", flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_during_startup)
    names = ["engine"] if len(children) == 1 else ["prefill engine", "decode engine"]
    for child, name in zip(children, names):
        threading.Thread(target=watch_engine, args=(child, name), name=f"{name}-watch", daemon=True).start()
    try:
        rc = run_frontend_workers(frontend_options, args.frontend_workers, args.log_level,
                                  args.log_format == "json", on_ready=announce_ready, on_stop=draining,
                                  on_force=stop_at_once)
    finally:
        stopping.set()
        stop_children(frontend_options.drain_timeout + 10)
    if engine_died.is_set():
        code = died_code[0] if died_code else 1
        return rc or (code if code and code > 0 else 1)
    return rc


# -- plan ------------------------------------------------------------------------------------------

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory_size(text: str) -> int:
    """`141GiB`, `141GB`, `80e9` -> bytes (GB = 10^9, GiB = 2^30, a bare number is bytes)."""
    value = text.strip().lower().replace(" ", "")
    number = value.rstrip("kmgtib")
    unit = value[len(number):]
    try:
        amount = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 141GiB, 80GB)") from None
    if unit not in _SIZE_UNITS or amount <= 0:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (units: B, KB, MB, GB, TB, KiB ... TiB)")
    return int(amount * _SIZE_UNITS[unit])


def _format_plan(plan: dict) -> str:
    """`tandem plan`'s table (the numbers of `ServingPlan.as_dict`)."""
    gib = 2**30

    def size(n: int | None) -> str:
        return "-" if n is None else f"{n / gib:,.2f} GiB"

    where = (f"a GPU with {size(plan['device_memory_bytes'])} usable" if plan["device_memory_bytes"] is not None
             else f"{plan['device']} (--cpu-kv-cache-gb)")
    lines = [f"{plan['model']} on {where}: {plan['dtype']}, quantization {plan['quantization']}, "
             f"max_model_len {plan['max_model_len']}, max_num_seqs {plan['max_num_seqs']}, "
             f"block_size {plan['block_size']}",
             f"  weights              {plan['weight_bytes']:>16,} B  {size(plan['weight_bytes'])}",
             f"  cache budget         {plan['budget_bytes'] or 0:>16,} B  {size(plan['budget_bytes'])}",
             f"  activation reserve   {plan['reserved_bytes']:>16,} B  {size(plan['reserved_bytes'])}",
             f"  KV cache             {plan['kv_cache_bytes']:>16,} B  {size(plan['kv_cache_bytes'])}",
             f"  state (+checkpoints) {plan['state_bytes']:>16,} B  {size(plan['state_bytes'])}",
             "  cache groups:"]
    for g in plan["groups"]:
        if "num_blocks" in g:
            window = f", window {g['sliding_window']}" if g["sliding_window"] else ""
            lines.append(f"    {g['name']} ({g['kind']}{window}, {g['layers']} layers): {g['bytes_per_token']:,} B "
                         f"per token, {g['num_blocks']:,} blocks = {g['kv_tokens']:,} KV tokens")
        else:
            lines.append(f"    {g['name']} ({g['kind']}, {g['layers']} layers): {g['bytes_per_slot']:,} B per slot "
                         f"(and per checkpoint), {g['num_slots']:,} request slots, "
                         f"{g['num_checkpoint_slots']:,} checkpoint slots")
    for length, count in plan["requests"].items():
        lines.append(f"  concurrent requests at {int(length):,} tokens of context: {count:,}")
    return "\n".join(lines)


def cmd_plan(args) -> int:
    """The engine's memory plan for a model on a GPU of `--gpu-memory` usable bytes, computed
    on the meta device (nothing allocated, no GPU needed)."""
    from tandem.engine_service.worker.serving_plan import WeightsDoNotFit, plan_serving

    try:
        config = _engine_config(args)
    except options.FlagValueError as exc:
        raise StartupError(exc.flag, exc.value, exc.reason) from None
    try:
        plan = plan_serving(config, args.gpu_memory)
    except WeightsDoNotFit as exc:
        raise StartupError("--gpu-memory", args.gpu_memory, str(exc)) from None
    except ValueError as exc:
        raise StartupError("--model", args.model, str(exc)) from None
    report = plan.as_dict(args.context_length or [plan.max_model_len])
    print(json.dumps(report, indent=2) if args.json else _format_plan(report))
    return 0


# -- client commands ------------------------------------------------------------------------------


def _print_response(resp, as_json: bool) -> None:
    if as_json:
        from google.protobuf import json_format

        print(json_format.MessageToJson(resp))
        return
    for c in resp.choices:
        prefix = f"[{c.index}] " if len(resp.choices) > 1 else ""
        if c.text:
            print(prefix + c.text)
        else:
            _note_empty(prefix, c)


def _note_empty(prefix: str, choice) -> None:
    """A choice without text is said on stderr, not printed as an empty line."""
    from tandem.v1 import common_pb2

    reason = common_pb2.FinishReason.Name(choice.finish_reason).removeprefix("FINISH_REASON_").lower()
    why = "the model ended its answer at once" if reason == "stop" else f"finish reason {reason}"
    sys.stderr.write(f"{prefix}(no text: {why})\n")


def _ready_client(args):
    """A TandemClient whose server is ready (waiting up to --wait seconds)."""
    from tandem.client import TandemClient

    client = TandemClient(args.address, security=_security(args))
    try:
        client.wait_ready(args.wait)
    except BaseException:
        client.close()
        raise
    return client


def _stream_text(call) -> tuple[str, object]:
    """Prints a one-choice stream's text as it arrives; returns the text and the last choice."""
    text, last = [], None
    for msg in call:
        for c in msg.choices:
            sys.stdout.write(c.text)
            text.append(c.text)
            last = c
        sys.stdout.flush()
    return "".join(text), last


def cmd_generate(args) -> int:
    request = options.from_args(ClientArgs, args)
    with _ready_client(args) as client:
        if args.stream:
            text, last = _stream_text(client.stream(args.prompt, **request.sampling_kwargs()))
            if text:
                print()
            elif last is not None:
                _note_empty("", last)
        else:
            _print_response(client.generate(args.prompt, **request.sampling_kwargs()), args.json)
    return 0


def cmd_chat(args) -> int:
    """One message answered, or an interactive chat (replies streamed as they are generated)."""
    request = options.from_args(ClientArgs, args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    with _ready_client(args) as client:
        if args.message:
            messages.append({"role": "user", "content": args.message})
            _print_response(client.chat(messages, **request.sampling_kwargs()), args.json)
            return 0
        kwargs = {**request.sampling_kwargs(), "n": None}  # one reply to continue the chat with
        while True:  # interactive
            try:
                line = input("you> ")
            except EOFError:
                print()
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            sys.stdout.write("model> ")
            sys.stdout.flush()
            reply, last = _stream_text(client.stream(messages=messages, **kwargs))
            print()
            if not reply and last is not None:
                _note_empty("", last)
            messages.append({"role": "assistant", "content": reply})


# -- the parser -----------------------------------------------------------------------------------


def _version() -> str:
    """The installed version of the `tandem` command's distribution."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tandem-common")
    except PackageNotFoundError:
        return "unknown (not installed)"


def engine_installed() -> bool:
    """Whether the engine distribution is importable (found without importing it)."""
    try:
        return importlib.util.find_spec(ENGINE_PACKAGE) is not None
    except ImportError:
        return False


def build_parser() -> argparse.ArgumentParser:
    from tandem.security import add_security_args

    parser = options.ArgumentParser(prog="tandem", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"tandem {_version()}")
    parser.add_argument("--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"],
                        help="log level; debug also prints tracebacks of errors")
    parser.add_argument("--log-format", default="auto", choices=["auto", "json", "console"],
                        help="log lines as JSON records or readable text; auto: console on a terminal, "
                             "json otherwise")
    sub = parser.add_subparsers(dest="command", required=True)
    with_engine = engine_installed()

    if with_engine:
        from tandem.engine_service.config_flags import add_engine_flags

        serve = sub.add_parser("serve", help="engine + frontend together")
        add_engine_flags(serve)
        options.add_flags(serve, ServerArgs, title="frontend server")
        options.add_flags(serve, FrontendServingArgs, {"engine_transport": "mux"}, title="frontend")
        options.add_flags(serve, ServeArgs, {"frontend_workers": "auto"}, title="engine child and frontend workers")
        options.add_flags(serve, EngineCoreArgs, title="engine core")
        options.add_flags(serve, MetricsArgs, title="metrics (the frontend's)")
        options.add_flags(serve, EngineMetricsArgs, title="metrics (the engine child's)")
        options.add_flags(serve, TracingArgs, title="tracing (the frontend's and the engine child's)")
        add_security_args(serve, admin=True)  # clients → frontend
        add_security_args(serve, "engine-", server=True, client=True)  # frontend → engine child, both ends
        serve.set_defaults(fn=cmd_serve)

        engine = sub.add_parser("engine", help="the engine service alone")
        add_engine_flags(engine)
        options.add_flags(engine, EngineServerArgs, title="engine server")
        options.add_flags(engine, MetricsArgs, title="metrics")
        options.add_flags(engine, EngineMetricsArgs, title="metrics")
        options.add_flags(engine, EngineCoreArgs, title="engine core")
        options.add_flags(engine, TracingArgs, title="tracing")
        add_security_args(engine)
        engine.set_defaults(fn=cmd_engine)
        serve.set_defaults(engine_parser=engine)

        plan = sub.add_parser("plan", help="weights, KV cache and concurrent requests of a model on a GPU, "
                                            "from the engine's memory planner (no GPU needed)")
        add_engine_flags(plan)
        plan.add_argument("--gpu-memory", type=parse_memory_size, default=None, metavar="SIZE",
                          help="usable memory of the GPU planned for, e.g. 139GiB or 141GB (without it: the "
                               "engine's CPU budget, --cpu-kv-cache-gb)")
        plan.add_argument("--context-length", type=int, action="append", default=None, metavar="TOKENS",
                          help="count the requests that fit at this context length (repeatable; default: "
                               "--max-model-len)")
        plan.add_argument("--json", action="store_true", help="print the plan as JSON")
        plan.set_defaults(fn=cmd_plan)

    front = sub.add_parser("frontend", help="the frontend alone, in front of one or more engines")
    options.add_flags(front, ServerArgs, title="frontend server")
    options.add_flags(front, FrontendArgs, title="frontend")
    options.add_flags(front, MetricsArgs, title="metrics")
    options.add_flags(front, TracingArgs, title="tracing")
    add_security_args(front, admin=True)  # clients → frontend
    add_security_args(front, "engine-", server=False, client=True)  # frontend → engines
    front.set_defaults(fn=cmd_frontend)

    gen = sub.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    options.add_flags(gen, ClientArgs)
    add_security_args(gen, server=False, client=True)
    gen.set_defaults(fn=cmd_generate)

    chat = sub.add_parser("chat", help="chat with the served model (interactive without a message)")
    chat.add_argument("message", nargs="?", help="one message to answer (omit for an interactive chat)")
    chat.add_argument("--system", default=None, help="system message")
    options.add_flags(chat, ClientArgs)
    add_security_args(chat, server=False, client=True)
    chat.set_defaults(fn=cmd_chat)

    if with_engine and importlib.util.find_spec("tandem.bench") is not None:
        from tandem.bench.cli import add_bench_parser

        add_bench_parser(sub)  # tandem bench roofline|throughput|serve|report
    options.finish_parser(parser)
    return parser


# -- errors: one line, or one JSON record ---------------------------------------------------------


def _report_line(args, message: str, **fields) -> None:
    """One error line on stderr: plain text, or one JSON record with --log-format json."""
    command = getattr(args, "command", None) or "tandem"
    if getattr(args, "log_format", "console") == "json":
        from datetime import datetime, timezone

        stamp = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        sys.stderr.write(json.dumps({"event": "error", "level": "error", "timestamp": stamp, "command": command,
                                     "error": message, **fields}) + "\n")
    else:
        sys.stderr.write(f"tandem {command}: error: {message}\n")
    sys.stderr.flush()


def _debug(args) -> bool:
    return getattr(args, "log_level", "info") == "debug"


def _fail(args, exc: BaseException, message: str, code: int, **fields) -> int:
    if _debug(args):
        import traceback

        traceback.print_exception(exc)
    _report_line(args, message, **fields)
    return code


def main(argv: list[str] | None = None) -> int:
    args = options.parse_args(build_parser(), argv)
    if args.log_format == "auto":
        args.log_format = "console" if sys.stderr.isatty() else "json"
    from tandem.logging_setup import configure_logging

    configure_logging(args.log_level, json=args.log_format == "json")
    import grpc

    from tandem.readiness import ServerNotReady

    server_command = args.command in ("serve", "engine", "frontend")
    try:
        return args.fn(args) or 0
    except (StartupError, options.FlagValueError) as exc:
        return _fail(args, exc, str(exc), 2, flag=exc.flag, value=str(exc.value))
    except ServerNotReady as exc:
        return _fail(args, exc, str(exc), 3, address=getattr(args, "address", ""))
    except grpc.RpcError as exc:
        code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
        details = (exc.details() if hasattr(exc, "details") else str(exc)) or ""
        where = getattr(args, "address", "")
        return _fail(args, exc, f"the server at {where} answered {code}: {details.splitlines()[0] if details else ''}",
                     4, status=code)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for the user; the traceback with --log-level debug
        rc = _fail(args, exc, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", 1)
        if server_command:
            # gRPC's asyncio objects complain when collected after their loop closed; the error
            # has been reported, so leave without that noise.
            sys.stdout.flush()
            os._exit(rc)
        return rc


if __name__ == "__main__":
    sys.exit(main())
