"""KV transfer between two processes on one GPU: bytes equal, GB/s against a device copy, and two
engine processes (producer, consumer) giving one engine's greedy tokens.

Usage (H200): ``python -P -m tandem.gpu_checks.kv_transfer --out DIR``
CPU smoke test: ``python -P -m tandem.gpu_checks.kv_transfer --out DIR --device cpu
--model dummy:tiny-llama --transports tcp --blocks 64 --prompt-len 40 --engine-blocks 256``

Parts (each catches its own exceptions into the report):

``pull``: a child process allocates a KV cache shaped like the model's (every paged group,
``--blocks`` blocks, content from fixed seeds) and serves it under leases exactly as a producer
engine does (`KVPullServer`, CUDA IPC export). This process pulls all the blocks into a
permuted set of its own blocks with `KVConnectorWorker`, once per transport and ``--reps``
times, and checks that the bytes equal the content regenerated here from the same seeds. It
reports GB/s per transport (the first CUDA IPC pull opens the handles and is reported apart)
against two device copies measured in the same run on the same bytes: the same block gather /
scatter between two local caches, and one contiguous ``copy_`` of that many bytes.

``engines``: two ``tandem engine`` processes on the device (``--kv-role producer`` with the
first transport, ``--kv-role consumer``) with the same dummy weights. For ``--prompts`` random
prompts of ``--prompt-len`` tokens: the prefill leg on the producer (``do_remote_decode``, one
token), the decode leg on the consumer, once per transport (the decode leg's
``remote_transport`` set to it); the tokens must equal the producer's own single-engine run of
the same prompt (its prefix cache flushed in between, so both prefills compute the whole prompt),
up to near ties (`judge_divergence`). The consumer's stats give the engine-level GB/s (bytes pulled / summed load
time, which includes the handshake and the wait for the next step).

Writes ``DIR/kv_transfer.json`` and the same as a bench record ``DIR/kv_transfer-<model>-<time>.json``
(`tandem bench report` reads it), prints a table last, exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from tandem.gpu_checks.divergence import TIE_NATS, TOP_LOGPROBS, judge_divergence  # noqa: F401 - TIE_NATS re-exported

CHILD_FLAG = "--serve-child"
CHECK_PROMPT = (1, 2, 3)  # the pull part's leases are made for this prompt


# -- the producer-side child ------------------------------------------------------------------------


def _layout(model: str):
    """The model's cache layout, from its config alone (no weights)."""
    from tandem.engine_service.cache.cache_spec import attention_layout
    from tandem.engine_service.dummy_configs import get_dummy_config

    if not model.startswith("dummy:"):
        raise ValueError("the pull part builds the cache from a dummy config: pass --model dummy:<name>")
    cfg = get_dummy_config(model.removeprefix("dummy:"))
    layers = cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return attention_layout((None,) * layers, cfg["num_key_value_heads"], head_dim, "bfloat16"), layers


def _filled_cache(model: str, num_blocks: int, block_size: int, device: torch.device):
    """Cache tensors with fixed-seed content (layer l from seed 1000 + l), and their block I/O."""
    from tandem.engine_service.cache.cache_tensors import allocate_cache_tensors
    from tandem.engine_service.kv_connector.block_io import KVBlockIO
    from tandem.engine_service.cache.memory_plan import GroupPlan, MemoryPlan

    layout, layers = _layout(model)
    groups = tuple(GroupPlan(g.name, g.spec, g.layer_ids, num_blocks=num_blocks,
                             bytes_per_block=g.bytes_per_block(block_size)) for g in layout.groups)
    tensors = allocate_cache_tensors(layout, MemoryPlan(groups=groups, block_size=block_size), layers, device)
    return layout, tensors, KVBlockIO(layout, tensors)


def _fill(tensors, device: torch.device) -> None:
    for layer, t in enumerate(tensors.kv_caches):
        if t is None:
            continue
        g = torch.Generator(device=device).manual_seed(1000 + layer)
        t.copy_(torch.randn(t.shape, generator=g, device=device, dtype=torch.float32).to(t.dtype))


def serve_child(args: argparse.Namespace) -> int:
    """The producer: fill a cache, serve pulls under `--leases` leases, until stdin closes."""
    from tandem.engine_service.kv_connector.auth import prompt_digest
    from tandem.engine_service.kv_connector.cuda_ipc import CudaIpcChannel
    from tandem.engine_service.kv_connector.leases import LeasedBlocks, LeaseTable
    from tandem.engine_service.kv_connector.tcp_transport import KVPullServer

    device = torch.device(args.device)
    _, tensors, io = _filled_cache(args.model, args.blocks, args.block_size, device)
    _fill(tensors, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    leases = LeaseTable()
    ids = list(range(args.blocks))
    # Every lease is bound to one fixed prompt's digest (`CHECK_PROMPT`), as an engine's would be to its prompt.
    granted = [leases.grant(f"r{i}", LeasedBlocks(f"r{i}", [list(ids) for _ in io.layers]), 3600,
                            prompt_digest=prompt_digest(CHECK_PROMPT)) for i in range(args.leases)]
    lease_ids = [[lease.lease_id, lease.secret] for lease in granted]
    ipc = CudaIpcChannel() if device.type == "cuda" else None
    nixl = None
    if "nixl" in args.transports:
        from tandem.engine_service.kv_connector.nixl_transport import NixlEndpoint

        nixl = NixlEndpoint("kv-check-producer", io)
    server = KVPullServer("127.0.0.1", 0, leases, io.iter_block_views,
                          ipc_export=(lambda: ipc.export_handles(io)) if ipc is not None else None,
                          nixl_export=nixl.memory if nixl is not None else None).start()
    print(json.dumps({"port": server.port, "leases": lease_ids}), flush=True)
    sys.stdin.read()  # the parent closes stdin when done
    server.close()
    return 0


# -- part: pull -------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_copy(fn, device: torch.device, reps: int) -> float:
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / reps


def _read_hello(child: subprocess.Popen) -> dict[str, Any]:
    """The child's address line (log lines may come before it)."""
    while True:
        line = child.stdout.readline()
        if not line:
            raise RuntimeError(f"the producer child exited with {child.wait()} before serving")
        if line.startswith('{"port"'):
            return json.loads(line)


def part_pull(args: argparse.Namespace) -> dict[str, Any]:
    from tandem.engine_service.kv_connector.auth import prompt_digest
    from tandem.engine_service.kv_connector.cuda_ipc import CudaIpcChannel
    from tandem.engine_service.kv_connector.metadata import KVConnectorMetadata, LoadSpec
    from tandem.engine_service.kv_connector.worker_side import KVConnectorWorker

    device = torch.device(args.device)
    n = args.blocks
    child = subprocess.Popen(
        [sys.executable, "-P", "-m", "tandem.gpu_checks.kv_transfer", CHILD_FLAG, "--device", args.device,
         "--model", args.model, "--blocks", str(n), "--block-size", str(args.block_size),
         "--leases", str(len(args.transports) * (args.reps + 1)), "--transports", ",".join(args.transports)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        hello = _read_hello(child)
        leases = iter(hello["leases"])
        # This process's cache: one block more than the child's, blocks written in reverse order.
        _, local, io = _filled_cache(args.model, n + 1, args.block_size, device)
        _, expected, expected_io = _filled_cache(args.model, n, args.block_size, device)
        _fill(expected, device)
        nixl = None
        if "nixl" in args.transports:
            from tandem.engine_service.kv_connector.nixl_transport import NixlEndpoint

            endpoint = NixlEndpoint("kv-check-consumer", io)
            nixl = lambda: endpoint  # noqa: E731
        worker = KVConnectorWorker(io, CudaIpcChannel() if device.type == "cuda" else None, timeout_s=600, nixl=nixl)
        remote_ids = [list(range(n)) for _ in io.layers]
        local_ids = [list(range(n, 0, -1)) for _ in io.layers]
        nbytes = sum(n * b for b in io.block_bytes)
        out: dict[str, Any] = {"blocks": n, "bytes": nbytes, "block_bytes": io.block_bytes, "transports": {}}
        ok = True
        for transport in args.transports:
            times = []
            for rep in range(args.reps + 1):
                for layer_t in local.kv_caches:
                    if layer_t is not None:
                        layer_t.zero_()
                _sync(device)
                lease_id, secret = next(leases)
                spec = LoadSpec(request_id=f"{transport}-{rep}", remote_engine_id="child", remote_host="127.0.0.1",
                                remote_port=hello["port"], lease_id=lease_id, lease_secret=secret,
                                prompt_digest=prompt_digest(CHECK_PROMPT), transport=transport,
                                remote_block_ids=remote_ids, local_block_ids=local_ids, num_tokens=n * args.block_size)
                t0 = time.perf_counter()
                worker.apply(KVConnectorMetadata(start_loads=[spec]))
                while not worker.wait(0.001):
                    pass
                report = worker.poll()
                _sync(device)
                times.append(time.perf_counter() - t0)
                if report.failed:
                    raise RuntimeError(f"{transport}: {report.failed}")
            equal = all(
                torch.equal(t.index_select(1, torch.tensor(local_ids[0], device=device)), e[:, :n])
                for t, e in zip(local.kv_caches, expected.kv_caches) if t is not None)
            ok &= equal
            steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
            out["transports"][transport] = {
                "bytes_equal": equal, "first_s": round(times[0], 5), "median_s": round(steady, 5),
                "gb_per_s": round(nbytes / steady / 1e9, 3), "first_gb_per_s": round(nbytes / times[0] / 1e9, 3)}
        # Device copies of the same bytes, same run.
        src = [t for t in expected.kv_caches if t is not None]
        dst = [t for t in local.kv_caches if t is not None]
        ridx = torch.arange(n, device=device)
        lidx = torch.tensor(local_ids[0], device=device)

        def gather_scatter() -> None:
            for s, d in zip(src, dst):
                d.index_copy_(1, lidx, s.index_select(1, ridx))

        flat_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        flat_dst = torch.empty_like(flat_src)
        t_gs = _time_copy(gather_scatter, device, args.reps)
        t_flat = _time_copy(lambda: flat_dst.copy_(flat_src), device, args.reps)
        out["device_copy"] = {"block_gather_scatter_gb_per_s": round(nbytes / t_gs / 1e9, 2),
                              "contiguous_copy_gb_per_s": round(nbytes / t_flat / 1e9, 2)}
        out["ok"] = ok
        worker.close()
        return out
    finally:
        try:
            child.stdin.close()
            child.wait(30)
        except Exception:  # noqa: BLE001
            child.kill()


# -- part: engines ----------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(args: argparse.Namespace, role: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    argv = [sys.executable, "-P", "-m", "tandem.cli", "engine", "--host", "127.0.0.1", "--port", str(port),
            "--model", args.model, "--device", args.device, "--max-model-len", str(args.prompt_len + 64),
            "--num-kv-blocks", str(args.engine_blocks), "--block-size", str(args.block_size),
            "--kv-role", role, "--kv-transport", args.transports[0] if role == "producer" else "tcp"]
    if role == "consumer":
        argv += ["--kv-producer", "127.0.0.1:*"]  # the producer on this host, at the port it picked
    if args.device == "cpu":
        argv += ["--attention-backend", "torch"]
    env = {**os.environ, "TANDEM_LOG_LEVEL": "warning", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env, cwd="/")
    address = f"127.0.0.1:{port}"
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{role} engine exited with {proc.returncode} (log: {log})")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Engine"), timeout=1).status == 1:
                return proc, address
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{role} engine not serving after {args.startup_timeout}s (log: {log})")


def part_engines(args: argparse.Namespace) -> dict[str, Any]:
    import grpc
    import msgspec
    from google.protobuf import json_format

    from tandem.core_protocol import KVTransferParams
    from tandem.proto_wire import kv_transfer_from_proto, kv_transfer_to_proto
    from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    procs = []
    try:
        producer, paddr = _engine(args, "producer", args.out / "producer.log")
        procs.append(producer)
        consumer, caddr = _engine(args, "consumer", args.out / "consumer.log")
        procs.append(consumer)
        pstub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(paddr))
        cstub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(caddr))

        def call(stub, rid, tokens, max_tokens, params=None, logprobs=None):
            sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            if logprobs is not None:
                sampling.logprobs = logprobs
            req = engine_pb2.EngineRequest(request_id=rid, prompt_token_ids=tokens, sampling=sampling)
            if params is not None:
                req.kv_transfer_params.CopyFrom(kv_transfer_to_proto(params))
            toks, last, alternatives = [], None, []
            for msg in stub.Stream(req, timeout=600):
                toks += list(msg.token_ids)
                alternatives += [{t.token_id: t.logprob for t in lp.top} for lp in msg.logprobs]
                last = msg
            return (toks, last, alternatives) if logprobs is not None else (toks, last)

        def flush_prefix_cache(stub) -> None:
            stub.Utility(common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_FLUSH_PREFIX_CACHE), timeout=60)

        def stats() -> dict:
            r = cstub.Utility(common_pb2.UtilityRequest(command=common_pb2.UTILITY_COMMAND_STATS), timeout=30)
            return json_format.MessageToDict(r.result)

        from tandem.engine_service.dummy_configs import get_dummy_config

        g = torch.Generator().manual_seed(0)
        vocab = int(get_dummy_config(args.model.removeprefix("dummy:"))["vocab_size"])
        out: dict[str, Any] = {"prompts": args.prompts, "prompt_len": args.prompt_len, "transports": {}}
        ok = True
        for transport in args.transports:
            # Fresh prompts per transport: the consumer's prefix cache holds the earlier ones.
            prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
            refs = [call(pstub, f"{transport}-ref{i}", p, args.output_len, logprobs=TOP_LOGPROBS)
                    for i, p in enumerate(prompts)]
            # The prefill legs then compute their prompts in full, as the references did (a prefix-cache
            # hit would compute the last block alone: other kernels, other rounding).
            flush_prefix_cache(pstub)
            before = stats()
            mismatches, near_ties, equal = [], [], 0
            for i, p in enumerate(prompts):
                first, last = call(pstub, f"{transport}{i}-p", p, 1, KVTransferParams(do_remote_decode=True))
                params = msgspec.structs.replace(kv_transfer_from_proto(last.kv_transfer_params),
                                                 remote_transport=transport)
                rest, _ = call(cstub, f"{transport}{i}-d", p + first, args.output_len - 1, params)
                verdict = judge_divergence(refs[i][0], first + rest, refs[i][2])
                if verdict is None:
                    equal += 1
                else:
                    (near_ties if verdict["near_tie"] else mismatches).append({"prompt": i, **verdict})
            after = stats()

            def delta(key: str) -> float:
                return float(after.get(key, 0)) - float(before.get(key, 0))

            nbytes, secs = delta("kv_remote_bytes_pulled"), delta("kv_remote_load_seconds")
            out["transports"][transport] = {
                "tokens_equal": equal == len(prompts), "prompts_equal": equal, "near_ties": near_ties,
                "mismatches": mismatches[:3],
                "tokens_loaded": int(delta("kv_remote_tokens_loaded")), "bytes_pulled": int(nbytes),
                "load_seconds": round(secs, 4), "engine_gb_per_s": round(nbytes / secs / 1e9, 2) if secs else None}
            # Near ties are allowed (see TIE_NATS); the pull part checks the bytes themselves exactly.
            ok &= not mismatches and int(delta("kv_remote_tokens_loaded")) == args.prompts * args.prompt_len
        out["ok"] = ok
        return out
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


# -- main -------------------------------------------------------------------------------------------


def _guarded(report: dict[str, Any], name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        report["parts"][name] = fn()
    except Exception as exc:  # noqa: BLE001 - every part reports its own failure
        report["parts"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc()}
    report["parts"][name]["seconds"] = round(time.perf_counter() - t0, 1)


def _table(report: dict[str, Any]) -> str:
    lines = [f"kv_transfer on {report['device']} ({report['model']}): {'OK' if report['ok'] else 'FAILED'}"]
    pull = report["parts"].get("pull", {})
    for name, t in pull.get("transports", {}).items():
        lines.append(f"  pull {name:9s} {pull['bytes'] / 1e6:9.1f} MB  bytes_equal={t['bytes_equal']}  "
                     f"{t['gb_per_s']:8.2f} GB/s (first {t['first_gb_per_s']:.2f})")
    if "device_copy" in pull:
        d = pull["device_copy"]
        lines.append(f"  device copy: block gather/scatter {d['block_gather_scatter_gb_per_s']:.2f} GB/s, "
                     f"contiguous {d['contiguous_copy_gb_per_s']:.2f} GB/s")
    for name, t in report["parts"].get("engines", {}).get("transports", {}).items():
        lines.append(f"  engines {name:9s} equal {t['prompts_equal']}, near ties {len(t['near_ties'])}, "
                     f"mismatches {len(t['mismatches'])}  loaded={t['tokens_loaded']} tokens  "
                     f"{t['engine_gb_per_s']} GB/s (engine-level)")
    for name, part in report["parts"].items():
        if "error" in part:
            lines.append(f"  {name}: {part['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="folder for kv_transfer.json and the engines' logs")
    parser.add_argument("--model", default="dummy:qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--transports", type=lambda s: s.split(","), default=["cuda_ipc", "tcp"],
                        help="comma-separated: cuda_ipc, tcp, nixl (nixl: the nixl extra installed)")
    parser.add_argument("--blocks", type=int, default=512, help="pull part: blocks pulled (16 tokens each)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--leases", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=int, default=8, help="engines part: prompts")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--engine-blocks", type=int, default=4096, help="engines part: --num-kv-blocks of each")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--skip-engines", action="store_true")
    args = parser.parse_args(argv)
    if args.serve_child:
        return serve_child(args)
    if args.out is None:
        parser.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TANDEM_LOG_LEVEL", "warning")
    from tandem.bench.results import new_record, write_record

    # Also a `tandem bench report` record (kind kv_transfer), for docs/benchmarks.md.
    record = new_record("kv_transfer", args.model, {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()}, device=args.device)
    report: dict[str, Any] = {"model": args.model, "device": args.device, "parts": {}}
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        report["parts"]["pull"] = {"ok": False, "error": "no CUDA device visible to torch"}
    else:
        if args.device.startswith("cuda"):
            report["gpu"] = torch.cuda.get_device_name()
        _guarded(report, "pull", lambda: part_pull(args))
        if not args.skip_engines:
            _guarded(report, "engines", lambda: part_engines(args))
    report["ok"] = all(p.get("ok") for p in report["parts"].values())
    (args.out / "kv_transfer.json").write_text(json.dumps(report, indent=2, default=str))
    record.results = {"kv_transfer": report}
    record.incomplete = not report["ok"]
    write_record(record, args.out)
    print(_table(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
