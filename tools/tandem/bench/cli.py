"""`tandem bench roofline|profile|throughput|serve|overhead|transport|soak|prefix|report`: argument parsing and the run wrapper.

Each measuring subcommand writes `<out>/<kind>-<model>-<timestamp>.json` (default out:
`bench/results/`), even when parts of it failed (they are listed under `errors`), and prints
a short table last. Engine flags are the ones `tandem serve` takes, so whatever the engine
gains (backends, graph options) is benchmarked with the same spelling.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from tandem.bench.results import DEFAULT_RESULTS_DIR
from tandem.cli_options import EngineCoreArgs, workers_count
from tandem.engine_service.config_flags import engine_config_from_args
from tandem.options import add_flags, engine_argv

_CONFIG_SKIP = {"fn", "bench_fn", "command", "bench_command"}


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _caps(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return values


def _ints_one(text: str) -> int:
    values = _ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return values[0]


def _count_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return _ints_one(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None


def _stack(text: str) -> dict[str, Any]:
    from tandem.bench.serve import stack_spec

    try:
        return stack_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            n, length = part.lower().split("x")
            shapes.append((int(n), int(length)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected NxLEN[,NxLEN...], got {text!r}") from None
    return shapes


def _shapes_or_none(text: str) -> list[tuple[int, int]]:
    return [] if text.strip().lower() in ("", "none") else _shapes(text)


def _key_value(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    value: Any = raw
    for cast in (int, float):
        try:
            value = cast(raw)
            break
        except ValueError:
            continue
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    return key.strip(), value


def _common(p: argparse.ArgumentParser, model: str, max_seconds: float) -> None:
    from tandem.engine_service.config_flags import add_engine_flags

    # The engine flags `tandem serve` takes (one declaration: tandem/engine_service/config.py).
    add_engine_flags(p)
    g = p.add_argument_group("benchmark output")
    g.add_argument("--out", default=DEFAULT_RESULTS_DIR, help="folder for the result JSON (default: %(default)s)")
    g.add_argument("--max-seconds", type=float, default=max_seconds,
                   help="wall-clock budget of the whole run; what does not fit is recorded as skipped "
                        "(default: %(default)s)")
    # Benchmark defaults: a real configuration with dummy weights, room for 256 sequences.
    p.set_defaults(model=os.environ.get("TANDEM_BENCH_MODEL", model), max_num_seqs=256, max_num_batched_tokens=8192)


def add_bench_parser(sub: Any) -> None:
    """Adds `bench` and its subcommands to the `tandem` command's subparsers."""
    bench = sub.add_parser("bench", help="benchmarks")  # the full list is set below
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    roof = bsub.add_parser("roofline", help="decode step time vs. the HBM floor, prefill MFU (GPU only)")
    _common(roof, "dummy:qwen3-8b", 240.0)
    g = roof.add_argument_group("roofline")
    g.add_argument("--batches", type=_ints, default=[1, 16, 64, 128, 256])
    g.add_argument("--contexts", type=_ints, default=[1024, 8192], help="context lengths (tokens incl. the new one)")
    g.add_argument("--prefill-shapes", type=_shapes, default=[(8, 1024), (1, 8192)], help="NxLEN,... (default 8x1024,1x8192)")
    g.add_argument("--point-seconds", type=float, default=6.0, help="timing budget per point")
    g.add_argument("--reps", type=int, default=30, help="most timed runs per point")
    g.add_argument("--copy-gib", type=float, default=2.0, help="buffer size of the bandwidth copy")
    g.add_argument("--headroom-gib", type=float, default=16.0, help="device memory kept free beside weights + KV")
    g.add_argument("--kv-aliasing", action="store_true",
                   help="run points whose KV does not fit by sharing blocks between sequences (flagged)")
    roof.set_defaults(fn=cmd_bench, bench_fn=_roofline)

    prof = bsub.add_parser("profile", help="one decode step (as served) and eager prefill steps, kernel by kernel "
                                           "and layer by layer, with torch.profiler (GPU only)")
    _common(prof, "dummy:qwen3-8b", 240.0)
    g = prof.add_argument_group("profile")
    g.add_argument("--decode-shapes", type=_shapes_or_none, default=[(1, 1024)], help="BATCHxCONTEXT,... or none")
    g.add_argument("--prefill-shapes", type=_shapes_or_none, default=[], help="NxLEN,... or none (default)")
    g.add_argument("--steps", type=int, default=10, help="profiled decode steps (medians per kernel)")
    g.add_argument("--reps", type=int, default=30, help="unprofiled timing runs per step kind")
    prof.set_defaults(fn=cmd_bench, bench_fn=_profile)

    thr = bsub.add_parser("throughput", help="offline throughput of the in-process engine vs. HF continuous batching")
    _common(thr, "dummy:qwen3-0.6b", 600.0)
    g = thr.add_argument_group("throughput")
    _workload_args(g)
    g.add_argument("--num-prompts", type=int, default=None, help="requests (default: the workload's standard count)")
    g.add_argument("--no-peer", action="store_true", help="skip the Hugging Face peer")
    g.add_argument("--peer-num-prompts", type=int, default=None,
                   help="run the peer (and the engine again) on the first N requests only")
    g.add_argument("--peer-cb", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="a ContinuousBatchingConfig field for the peer (repeatable)")
    g.add_argument("--warmup-requests", type=int, default=8)
    g.add_argument("--peer-static-batch-size", type=int, default=64,
                   help="requests per model.generate batch when the peer cannot use continuous batching "
                        "(hybrid models; default: %(default)s)")
    g.add_argument("--engine-share", type=float, default=0.45,
                   help="fraction of the time left that the engine's full-workload run may take; the rest "
                        "goes to the peer subset and the peer (default: %(default)s)")
    thr.set_defaults(fn=cmd_bench, bench_fn=_throughput)

    srv = bsub.add_parser("serve", help="TTFT/TPOT/ITL through frontend + engine over gRPC vs. in-process")
    _common(srv, "dummy:qwen3-0.6b", 600.0)
    g = srv.add_argument_group("serve")
    _workload_args(g)
    g.add_argument("--concurrency", type=_ints, default=[1, 16, 64, 256], help="levels, comma-separated")
    g.add_argument("--requests-per-level", type=int, default=None, help="default: max(2 x concurrency, 16)")
    g.add_argument("--level-seconds", type=float, default=60.0, help="time limit of each level (each side)")
    g.add_argument("--startup-timeout", type=float, default=600.0)
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory for the frontend (default: the model's, or a word-level stand-in)")
    g.add_argument("--no-in-process", action="store_true", help="skip the in-process comparison")
    g.add_argument("--warmup-requests", type=int, default=32,
                   help="short requests run on each side before timing, prompts spanning the workload's lengths (default: %(default)s)")
    g.add_argument("--engine-transport", choices=["stream", "mux"], default="mux",
                   help="frontend-engine transport of the served side (default: %(default)s, as tandem serve)")
    g.add_argument("--frontend-workers", type=workers_count, default="auto",
                   help="frontend processes of the served stack on one port (tandem serve --frontend-workers); "
                        "auto as tandem serve: one per 4 cores, 1 to 4")
    add_flags(g, EngineCoreArgs)  # the served stack's, as `tandem serve --engine-core`
    g.add_argument("--also-stack", dest="also_stacks", type=_stack, action="append", default=[],
                   metavar="CORE:TRANSPORT:WORKERS",
                   help="measure another served stack in the same call, e.g. thread:stream:1 (the stack "
                        "before the engine-core process) or thread:mux:4; repeatable. The primary stack is "
                        "--engine-core/--engine-transport/--frontend-workers")
    g.add_argument("--client-procs", type=_count_or_auto, default=1,
                   help="load-generator processes sharing each level's concurrency; 'auto' = min(4, cores // 4)")
    g.add_argument("--rounds", type=_ints_one, default=1,
                   help="N > 1: keep every side alive, run every level N times alternating the sides' order "
                        "(round 0 served first, round 1 in-process first, ...) on fresh requests each round, and "
                        "report per-metric medians (the workload is N x the level sizes; on a GPU needs "
                        "--num-kv-blocks, as every engine is on the device at once)")
    g = srv.add_argument_group("mixed workload (--mixed): long prompts arriving during decode traffic")
    g.add_argument("--mixed", action="store_true",
                   help="run the mixed workload once per --prefill-caps value instead of the concurrency levels")
    g.add_argument("--prefill-caps", type=_caps, default=[0, 512],
                   help="--max-prefill-tokens-per-seq of each run; 0 = no cap, the scheduler before fair "
                        "prefill (default: 0,512)")
    _mixed_traffic_args(g)
    srv.set_defaults(fn=cmd_bench, bench_fn=_serve)

    dis = bsub.add_parser("disagg", help="one engine vs a prefill + a decode engine on the same device, under the "
                                         "mixed workload (long prompts arriving during decode traffic)")
    _common(dis, "dummy:qwen3-8b", 900.0)
    g = dis.add_argument_group("disaggregated vs one engine")
    g.add_argument("--single-kv-blocks", type=int, default=None,
                   help="the single engine's --num-kv-blocks (default: 2 x --num-kv-blocks, what the two "
                        "engines hold together)")
    g.add_argument("--shapes", type=lambda text: [x for x in text.split(",") if x], default=["single", "disaggregated"],
                   help="which shapes to run, comma-separated (default: single,disaggregated)")
    g.add_argument("--startup-timeout", type=float, default=600.0)
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory for the frontend (default: the model's, or a word-level stand-in)")
    _mixed_traffic_args(dis.add_argument_group("mixed workload"))
    dis.set_defaults(fn=cmd_bench, bench_fn=_disagg)

    soak = bsub.add_parser("soak", help="random cancels, aborts, deadlines, n>1, stops and bad inputs, then a leak check")
    _common(soak, "smollm2-135m-instruct", 3600.0)
    g = soak.add_argument_group("soak")
    g.add_argument("--address", default=None,
                   help="frontend HOST:PORT of a running server (default: start `tandem serve` with the engine flags)")
    g.add_argument("--requests", type=_ints_one, default=1000, help="calls to make")
    g.add_argument("--concurrency", type=_ints_one, default=16, help="calls in flight at once")
    g.add_argument("--soak-seconds", type=float, default=None, help="stop starting calls after this long")
    g.add_argument("--soak-max-tokens", type=_ints_one, default=24, help="most tokens a call asks for")
    g.add_argument("--soak-seed", type=int, default=0)
    g.add_argument("--startup-timeout", type=float, default=600.0)
    g.add_argument("--tokenizer", default=None, help="tokenizer for a started server (default: the model's)")
    soak.set_defaults(fn=cmd_bench, bench_fn=_soak)

    pre = bsub.add_parser("prefix", help="prefix caching of a hybrid model: hit rate vs a full-attention model "
                                         "of the same depth, and its cost on a no-reuse workload")
    _common(pre, "dummy:qwen3.5-9b", 1200.0)
    g = pre.add_argument_group("prefix")
    g.add_argument("--compare-model", default=None,
                   help="full-attention model for the hit-rate comparison (default: dummy:<name>-full-attention)")
    g.add_argument("--num-prefixes", type=_ints_one, default=8)
    g.add_argument("--prefix-len", type=_ints_one, default=2000)
    g.add_argument("--suffix-len", type=_ints_one, default=100)
    g.add_argument("--requests-per-prefix", type=_ints_one, default=8)
    g.add_argument("--prefix-output-len", type=_ints_one, default=16)
    g.add_argument("--concurrency", type=_ints_one, default=16, help="shared-prefix requests in flight")
    g.add_argument("--noreuse-requests", type=_ints_one, default=256)
    g.add_argument("--noreuse-prompt-len", type=_ints_one, default=1000)
    g.add_argument("--noreuse-output-len", type=_ints_one, default=128)
    g.add_argument("--repeats", type=_ints_one, default=2, help="no-reuse runs per setting, alternating")
    g.add_argument("--warmup-requests", type=int, default=8)
    pre.set_defaults(fn=cmd_bench, bench_fn=_prefix)

    ovh = bsub.add_parser("overhead", help="host (CPU) time per engine step at N running sequences, model-free")
    _common(ovh, "host-only", 300.0)
    g = ovh.add_argument_group("overhead")
    g.add_argument("--batches", type=_ints, default=[256], help="running sequences, comma-separated")
    g.add_argument("--context", type=int, default=1024, help="tokens per sequence when timing starts")
    g.add_argument("--steps", type=int, default=50, help="decode steps timed per batch size")
    g.add_argument("--gpu-step-ms", type=float, default=None,
                   help="anchor: a GPU step time at the same batch (e.g. the roofline decode step); with several --batches it applies to each, so time one batch size per anchor")
    ovh.set_defaults(fn=cmd_bench, bench_fn=_overhead)

    tr = bsub.add_parser("transport", help="engine-core output transport: ZeroMQ IPC vs an OS pipe, per-step messages")
    g = tr.add_argument_group("benchmark output")
    g.add_argument("--out", default=DEFAULT_RESULTS_DIR, help="folder for the result JSON (default: %(default)s)")
    g.add_argument("--max-seconds", type=float, default=300.0)
    g = tr.add_argument_group("transport")
    g.add_argument("--shapes", default="decode-256,decode-256-logprobs5,decode-64,decode-1",
                   help="message shapes, comma-separated (default: %(default)s)")
    g.add_argument("--pings", type=int, default=2000, help="round trips timed per point")
    g.add_argument("--burst", type=int, default=5000, help="messages streamed back-to-back per point")
    tr.set_defaults(fn=cmd_bench, bench_fn=_transport, model="core-protocol", device="cpu")

    rep = bsub.add_parser("report", help="write docs/benchmarks.md and its plot from bench/results/*.json")
    rep.add_argument("--results-dir", default=DEFAULT_RESULTS_DIR)
    rep.add_argument("--markdown", default="docs/benchmarks.md")
    rep.add_argument("--plot", default="docs/benchmarks_decode.png")
    rep.set_defaults(fn=cmd_report)
    # `tandem --help` lists every benchmark, from the subcommands themselves.
    listing = next(a for a in sub._choices_actions if a.dest == "bench")
    listing.help = "benchmarks: " + ", ".join(bsub.choices) + " (report writes docs/benchmarks.md)"


def _mixed_traffic_args(g: Any) -> None:
    """The mixed workload's traffic flags (`serve --mixed` and `disagg`)."""
    g.add_argument("--mixed-decode-streams", type=int, default=32, help="closed-loop decode streams")
    g.add_argument("--mixed-decode-output-len", type=int, default=512)
    g.add_argument("--mixed-long-prompts", type=int, default=8)
    g.add_argument("--mixed-long-prompt-len", type=int, default=8000, help="clipped to the model's context")
    g.add_argument("--mixed-long-interval", type=float, default=2.0, help="seconds between long prompts")
    g.add_argument("--mixed-short-requests", type=int, default=40)
    g.add_argument("--mixed-short-prompt-len", type=int, default=32)
    g.add_argument("--mixed-short-interval", type=float, default=0.4, help="seconds between short requests")
    g.add_argument("--mixed-seconds", type=float, default=180.0, help="time limit of each run")


def _workload_args(g: Any) -> None:
    from tandem.bench.workloads import workload_names

    g.add_argument("--workload", default="nanovllm", choices=workload_names())
    g.add_argument("--scale", type=float, default=1.0, help="multiply every input/output length (quick runs)")


# -- running ---------------------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in _CONFIG_SKIP}


def cmd_bench(args: argparse.Namespace) -> int:
    """Run one measuring subcommand, write its JSON, print its short table last."""
    from tandem.bench.results import Deadline, new_record, write_record
    from tandem.bench.timing import GPURequiredError
    from tandem.engine_service.worker.model_runner import resolve_device

    kind = args.bench_command
    # Benchmarks use dummy weights and local files only: a Hugging Face Hub lookup (transformers
    # probing for downloadable attention kernels) must fail at once, not wait on a network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = resolve_device(args.device)
    try:
        if kind == "roofline":
            from tandem.bench.timing import require_cuda

            require_cuda(device, "tandem bench roofline")
    except GPURequiredError as exc:
        sys.stderr.write(f"tandem bench: {exc}\n")
        return 2
    record = new_record(kind, args.model, _config(args), device=device)
    deadline = Deadline(args.max_seconds)
    table: Callable[[dict[str, Any]], list[str]] | None = None
    try:
        table = args.bench_fn(record, args, deadline)
    except KeyboardInterrupt as exc:
        record.add_error("interrupted", exc)
    except Exception as exc:  # noqa: BLE001 - recorded; the JSON is still written
        record.add_error(kind, exc)
    path = write_record(record, args.out)
    print(f"tandem bench {kind}: {args.model} on {record.env.get('device')} (commit {record.env.get('git_commit')})")
    print(f"result: {path}")
    for err in record.errors:
        print(f"error in {err['stage']}: {err['error']}")
    if table is not None:
        for line in table(record.results):
            print(line)
    return 0 if not record.errors else 1


def _roofline(record: Any, args: argparse.Namespace, deadline: Any) -> Any:
    from tandem.bench import roofline

    options = roofline.RooflineOptions(
        batches=args.batches, contexts=args.contexts, prefill_shapes=args.prefill_shapes,
        copy_bytes=int(args.copy_gib * (1 << 30)), point_seconds=args.point_seconds, reps=args.reps,
        headroom_gib=args.headroom_gib, kv_aliasing=args.kv_aliasing)
    roofline.run_roofline(record, engine_config_from_args(args), options, deadline)
    return roofline.short_table


def _profile(record: Any, args: argparse.Namespace, deadline: Any) -> Any:
    from tandem.bench import kernel_profile

    options = kernel_profile.ProfileOptions(decode_shapes=args.decode_shapes, prefill_shapes=args.prefill_shapes,
                                            steps=args.steps, reps=args.reps)
    kernel_profile.run_profile(record, engine_config_from_args(args), options, deadline)
    return kernel_profile.short_table


def _throughput(record: Any, args: argparse.Namespace, deadline: Any) -> Any:
    from tandem.bench import throughput

    options = throughput.ThroughputOptions(
        workload=args.workload, num_prompts=args.num_prompts, scale=args.scale, peer=not args.no_peer,
        peer_num_prompts=args.peer_num_prompts, warmup_requests=args.warmup_requests,
        peer_cb_config=dict(args.peer_cb) or None, engine_share=args.engine_share,
        peer_static_batch_size=args.peer_static_batch_size)
    throughput.run_throughput(record, engine_config_from_args(args), options, deadline)
    return throughput.short_table


def _serve(record: Any, args: argparse.Namespace, deadline: Any) -> Any:
    from tandem.bench import serve

    if args.mixed:
        if args.rounds != 1:
            raise ValueError("--rounds applies to the concurrency levels, not to --mixed")
        return _mixed(record, args, deadline)

    options = serve.ServeOptions(
        workload=args.workload, scale=args.scale, concurrencies=args.concurrency,
        requests_per_level=args.requests_per_level, level_seconds=args.level_seconds,
        startup_timeout=args.startup_timeout, tokenizer=args.tokenizer, in_process=not args.no_in_process,
        warmup_requests=args.warmup_requests, engine_transport=args.engine_transport,
        frontend_workers=args.frontend_workers, client_procs=args.client_procs, engine_core=args.engine_core,
        also_stacks=args.also_stacks, rounds=args.rounds)
    serve.run_serve(record, engine_config_from_args(args), engine_argv(engine_config_from_args(args)), options, deadline)
    return serve.short_table


def _mixed_options(args: argparse.Namespace, prefill_caps: list[int]) -> Any:
    from tandem.bench import mixed

    return mixed.MixedOptions(
        prefill_caps=prefill_caps, decode_streams=args.mixed_decode_streams,
        decode_output_len=args.mixed_decode_output_len, num_long=args.mixed_long_prompts,
        long_prompt_len=args.mixed_long_prompt_len, long_interval_s=args.mixed_long_interval,
        num_short=args.mixed_short_requests, short_prompt_len=args.mixed_short_prompt_len,
        short_interval_s=args.mixed_short_interval, run_seconds=args.mixed_seconds,
        startup_timeout=args.startup_timeout, tokenizer=args.tokenizer)


def _mixed(record: Any, args: argparse.Namespace, deadline: Any) -> Any:
    from tandem.bench import mixed

    options = _mixed_options(args, args.prefill_caps)
    mixed.run_mixed(record, engine_config_from_args(args), engine_argv(engine_config_from_args(args)), options, deadline)
    return mixed.short_table


def _disagg(record: Any, args: argparse.Namespace, deadline: Any) -> Any:
    from tandem.bench import disagg

    config = engine_config_from_args(args)
    options = disagg.DisaggOptions(traffic=_mixed_options(args, []), single_kv_blocks=args.single_kv_blocks,
                                   shapes=args.shapes)
    disagg.run_disagg(record, config, engine_argv(config), options, deadline)
    return disagg.short_table


def _soak(record: Any, args: argparse.Namespace, deadline: Any) -> Any:
    from tandem.bench import soak

    options = soak.SoakOptions(num_requests=args.requests, concurrency=args.concurrency,
                               max_seconds=args.soak_seconds, max_tokens=args.soak_max_tokens, seed=args.soak_seed)
    if args.address:
        record.results["soak"] = soak.run_soak(args.address, options)
    else:
        record.results["soak"] = soak.run_soak_with_server(
            engine_config_from_args(args), engine_argv(engine_config_from_args(args)), options, args.tokenizer,
            min(args.startup_timeout, max(deadline.remaining(), 1.0)))
    if not record.results["soak"]["passed"]:
        record.add_error("soak", RuntimeError("soak failed: unexpected outcomes, per-call violations or leaks"))
    return soak.short_table


def _prefix(record: Any, args: argparse.Namespace, deadline: Any) -> Any:
    from tandem.bench import prefix

    options = prefix.PrefixOptions(
        compare_model=args.compare_model, num_prefixes=args.num_prefixes, prefix_len=args.prefix_len,
        suffix_len=args.suffix_len, requests_per_prefix=args.requests_per_prefix, output_len=args.prefix_output_len,
        concurrency=args.concurrency, noreuse_requests=args.noreuse_requests,
        noreuse_prompt_len=args.noreuse_prompt_len, noreuse_output_len=args.noreuse_output_len,
        repeats=args.repeats, warmup_requests=args.warmup_requests)
    prefix.run_prefix(record, engine_config_from_args(args), options, deadline)
    return prefix.short_table


def _transport(record: Any, args: argparse.Namespace, deadline: Any) -> Any:
    from tandem.bench import transport

    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in transport.SHAPES]
    if unknown:
        raise ValueError(f"unknown shapes {unknown}; known: {sorted(transport.SHAPES)}")
    transport.run_transport(record, shapes, args.pings, args.burst)
    return transport.short_table


def _overhead(record: Any, args: argparse.Namespace, deadline: Any) -> Any:
    from tandem.bench import overhead

    overhead.run_overhead(record, engine_config_from_args(args), args.batches, args.context, args.steps,
                          args.gpu_step_ms)
    return overhead.short_table


def cmd_report(args: argparse.Namespace) -> int:
    from tandem.bench.report import build_report

    out = build_report(args.results_dir, args.markdown, args.plot)
    print(f"wrote {out['markdown']} from {out['results']} result(s)" + (f" and {out['plot']}" if out["plot"] else ""))
    return 0
