"""Shared fixtures: the real SmolLM2 model (converted once), its Hugging Face twin, and real
`tandem` server processes on free loopback ports."""

from __future__ import annotations

import os

# CI has no GPU: Triton kernels run under the interpreter. Triton reads this when it is first
# imported, so it is set here, before any test module can import it (scripts/test.sh sets it too).
os.environ.setdefault("TRITON_INTERPRET", "1")
# The test-only `dummy:tiny-*` models (tests/dummy_models), found through the search path the
# product reads at every lookup; set in the environment so server subprocesses find them too.
os.environ["TANDEM_DUMMY_MODELS_PATH"] = os.pathsep.join(
    p for p in (os.path.join(os.path.dirname(os.path.abspath(__file__)), "dummy_models"),
                os.environ.get("TANDEM_DUMMY_MODELS_PATH")) if p)
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent

# The files that take a minute or more on the 2-core CI machine, longest first. scripts/test.sh
# runs files on two xdist workers in collection order; starting these first keeps one long file
# from running alone at the end while the other worker idles.
LONG_FILES = ("test_structured_output.py", "test_disaggregated_soak.py", "test_first_run.py", "test_soak.py",
              "test_preemption.py", "test_faults.py", "test_engine_core.py", "test_slim_frontend.py",
              "test_disaggregated.py", "test_bench_smoke.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: file order kept


# Children a test process may keep for its whole life: multiprocessing's helpers, started on the
# first use of a spawn context and ended by the interpreter's exit.
_LONG_LIVED_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    """The direct children of `pid` (of any of its threads); none once it is gone."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _live_descendants(pid: int) -> list[int]:
    """Every process below `pid` that has not exited (zombies, exited but not yet reaped, are
    not counted), multiprocessing's helpers excepted."""
    out: list[int] = []
    stack = [pid]
    while stack:
        for child in _children(stack.pop()):
            stack.append(child)
            try:
                state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z" and not any(h in _cmdline(child) for h in _LONG_LIVED_HELPERS):
                out.append(child)
    return out


def _own_listening_ports() -> list[int]:
    """TCP ports this process itself still listens on (an in-process server never stopped)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """At the end of the run (this fixture is set up first, so it is torn down last): no server
    process a test started is still alive, and no in-process server still listens. What is left
    is killed, and the run fails naming it."""
    yield
    deadline = time.monotonic() + 10.0  # processes stopped a moment ago may still be exiting
    while (left := _live_descendants(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.2)
    described = [f"{pid}: {_cmdline(pid)[:200]}" for pid in left]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    listening = _own_listening_ports()
    assert not left and not listening, (
        f"left behind by the tests: processes {described}, listening ports of this process {listening}")


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test: the CI box has 2 cores shared with other test processes,
    and two OpenMP threads fighting a busy core make each tiny matmul wait on a barrier."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _port_stretch() -> range:
    """This test process's ports for the servers it starts: below the kernel's ephemeral range
    (outgoing connections take their source ports there, so one could take a port the kernel had
    just handed out, between the check and the server's bind: a full run saw an engine child fail with
    "already in use"), a separate stretch for each xdist worker."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) % 8 if worker.isdigit() else 0
    size = max(0, (ephemeral_low - 10000) // 8)
    return range(10000 + index * size, 10000 + (index + 1) * size)


_PORTS = _port_stretch()
# Ports are handed out 16 apart: a server counts up from some of its ports (`--frontend-workers`'
# metrics ports, `--disaggregated`'s decode engine at --engine-port + 1), which must not be the
# next port handed out. From a random start: a later session need not meet this one's ports.
_PORT_STEP = 16
_next_port = random.randrange(max(1, len(_PORTS) // _PORT_STEP)) * _PORT_STEP


def free_port() -> int:
    """A port nothing listens on now, from this process's stretch (`_port_stretch`); the kernel's
    choice where the ephemeral range leaves no room below it."""
    global _next_port
    for _ in range(len(_PORTS) // _PORT_STEP):
        port = _PORTS[_next_port % len(_PORTS)]
        _next_port += _PORT_STEP
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_serving(address: str, service: str, timeout: float, proc: subprocess.Popen | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    """Polls grpc.health.v1 until `service` is SERVING; `credentials` for a TLS port."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before becoming ready")
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{service} at {address} not serving after {timeout}s")
    finally:
        channel.close()


class ServerProcess:
    """A `tandem` subcommand in its own process (real gRPC, real model)."""

    def __init__(self, args: list[str], env: dict | None = None, stderr: Path | None = None) -> None:
        self.args = args
        full_env = dict(os.environ)
        full_env.setdefault("TANDEM_LOG_LEVEL", "warning")
        full_env.update(env or {})
        # -P: never let the working directory shadow installed packages.
        # stderr: a file for the process's log lines (the engine child of `serve` shares it);
        # opened for append so that two processes writing lines never overwrite each other.
        self._stderr = open(stderr, "ab") if stderr is not None else None
        # A process group of its own (its id is the pid): `stop` ends whatever the server
        # started, also when the server itself died first.
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "tandem.cli", *args], env=full_env, cwd="/",
                                     stderr=self._stderr, start_new_session=True)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """`sig` to the server (it stops its children itself), then SIGKILL to its whole process
        group: to the server if it did not exit within `timeout`, and to anything left behind."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone: nothing was left
        self.proc.wait()
        if self._stderr is not None:
            self._stderr.close()
        return self.proc.returncode


def child_pid(pid: int, needle: str) -> int:
    """The one child process of `pid` whose command line contains `needle`."""
    children = _children(pid)
    matches = [c for c in children if needle in _cmdline(c)]
    assert len(matches) == 1, (needle, [(c, _cmdline(c)) for c in children])
    return matches[0]


def wait_not_serving(address: str, service: str, timeout: float = 30.0) -> bool:
    """Polls grpc.health.v1 until `service` is not SERVING (or the server is gone); False when it
    still serves after `timeout` seconds."""
    channel = grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if r.status != health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                return True  # already shut down: not serving either
            time.sleep(0.02)
        return False
    finally:
        channel.close()


def start_serve(extra: list[str] | None = None, timeout: float = 300.0, env: dict | None = None,
                credentials: grpc.ChannelCredentials | None = None,
                stderr: Path | None = None) -> tuple[ServerProcess, str, str]:
    """Starts `tandem serve` (engine child + frontend); returns (process, frontend, engine) addresses."""
    fport, eport = free_port(), free_port()
    server = ServerProcess(
        ["serve", "--host", "127.0.0.1", "--port", str(fport), "--engine-port", str(eport), *(extra or [])], env=env,
        stderr=stderr,
    )
    frontend, engine = f"127.0.0.1:{fport}", f"127.0.0.1:{eport}"
    try:
        wait_serving(frontend, "tandem.v1.Frontend", timeout, server.proc, credentials=credentials)
    except Exception:
        server.stop(signal.SIGKILL)
        raise
    return server, frontend, engine


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face directory (converted once, cached)."""
    from tandem.engine_service.worker.loader import resolve_model

    return Path(resolve_model("smollm2-135m-instruct", None).path)


@pytest.fixture(scope="session")
def hf_model(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def serve(smollm2_dir):
    """One `tandem serve` with the default model for the integration tests that share it
    (admin commands open: the prefix-cache tests flush the cache between cases)."""
    server, frontend, engine = start_serve(["--allow-admin-commands"])
    yield {"frontend": frontend, "engine": engine, "process": server}
    server.stop()


@pytest.fixture
def client(serve):
    from tandem.client import TandemClient

    with TandemClient(serve["frontend"]) as c:
        yield c


@pytest.fixture(scope="session")
def get_free_port():
    """`free_port` for test modules (conftest is not importable under --import-mode=importlib)."""
    return free_port


@pytest.fixture(scope="module")
def launch_serve(smollm2_dir):
    """Factory for extra `tandem serve` processes with their own flags; stopped when the test
    module ends (each serve holds a model and a KV pool: kept for the whole session, they add up
    past what the 2-core, 24 GiB CI machine holds)."""
    started: list[ServerProcess] = []

    def launch(extra: list[str], **kwargs) -> tuple[ServerProcess, str, str]:
        server, frontend, engine = start_serve(extra, **kwargs)
        started.append(server)
        return server, frontend, engine

    yield launch
    for s in started:
        s.stop()


def run_batch(runner, batch, previous_tokens=None):
    """`runner.forward` of a hand-built, Sequence-shaped batch (items with `seq`, `num_new_tokens`
    and `sample`, such as the scheduler's `ScheduledSeq`): the logits of its sampling rows, in batch
    order. Only tests drive a `ModelRunner` this way; the engine drives it through step plans and
    the worker's rows."""
    from tandem.engine_service.worker.input_batch import prepare_host_inputs

    return runner.forward(prepare_host_inputs(batch, runner.block_size), previous_tokens)


def drive_greedy(engine, prompts: list[list[int]], steps: int, on_step=None) -> list[list[int]]:
    """Run `prompts` through an in-process `LLMEngine` as requests `r0, r1, ...` (greedy, `steps`
    tokens each, EOS ignored) until it has no work; each request's tokens in prompt order.
    `on_step(engine)` runs after every step."""
    from tandem.engine_service.sequence import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for _ in range(5000):
        if not engine.has_work():
            break
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        if on_step is not None:
            on_step(engine)
    return [out[f"r{i}"] for i in range(len(prompts))]


def model_rows(model, caches, work, block_size: int) -> list:
    """One forward of a bare model (no runner) over `work`, `(Sequence, n new tokens)` pairs whose
    block tables already cover the new tokens: each sequence's float logits for its `n` rows.
    Advances each sequence's `num_computed_tokens` by `n`."""
    import torch

    from tandem.engine_service.worker.input_batch import build_model_inputs

    class Item:
        def __init__(self, seq, n: int) -> None:
            self.seq, self.num_new_tokens, self.sample = seq, n, True

    inputs = build_model_inputs([Item(s, n) for s, n in work], block_size, torch.device("cpu"))
    md = inputs.metadata
    logits = model.compute_logits(model(inputs.input_ids, md.positions, caches, md)).float()
    out = []
    for i, (seq, n) in enumerate(work):
        start = int(md.query_start_loc[i])
        out.append(logits[start : start + n])
        seq.num_computed_tokens += n
    return out


@pytest.fixture(scope="session")
def execute():
    """`run_batch`: a `ModelRunner`'s logits for a hand-built batch."""
    return run_batch


@pytest.fixture(scope="session")
def server_tools():
    """The process helpers above, for tests that assemble their own topology."""
    from types import SimpleNamespace

    return SimpleNamespace(ServerProcess=ServerProcess, free_port=free_port, wait_serving=wait_serving,
                           child_pid=child_pid, wait_not_serving=wait_not_serving)


# Model types whose RMSNorm scales are zero-centred (the weight is w in x * (1 + w)).
ZERO_CENTRED_NORMS = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}


def make_hf_checkpoint(tmp_path: Path, dummy_name: str, seed: int = 1234, router_std: float | None = None,
                       **overrides):
    """A seeded Hugging Face model of the dummy config `dummy_name` (with `overrides`) saved with
    save_pretrained; every parameter randomised (norm scales and biases too, so a weight that
    fails to load changes the logits). Hybrids get slow decays (A in (0.05, 1)) so the recurrent
    state matters over long prefixes; `router_std` makes an MoE router decisive (top-k choices far
    from ties). Returns (the transformers model, its directory)."""
    import torch
    import transformers

    from tandem.engine_service.dummy_configs import get_dummy_config

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
        "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
    }
    cfg = get_dummy_config(dummy_name) | overrides
    config_cls, model_cls = classes[cfg["model_type"]]
    zero_centred = cfg["model_type"] in ZERO_CENTRED_NORMS
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # the gated norm's plain scale
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.normal_(0.0, 0.2) if zero_centred else p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("A_log"):  # decays exp(-A * softplus(.)) with A in (0.05, 1): long memory
                p.copy_(torch.empty_like(p).uniform_(0.05, 1.0).log())
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif "conv1d" in name:
                p.normal_(0.0, 0.4)
            elif router_std is not None and name.endswith("mlp.gate.weight"):
                p.normal_(0.0, router_std)
            else:
                p.normal_(0.0, 0.1)
    path = tmp_path / dummy_name
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="session")
def hf_checkpoint():
    """`make_hf_checkpoint`, for the parity tests of several modules."""
    return make_hf_checkpoint


def can_allocate(bm, seq, num_new_tokens: int) -> bool:
    """Whether `bm.allocate(seq, num_new_tokens)` would succeed, asked without side effects: the
    lookup an admission makes, then every group manager's `fits` (only tests ask this)."""
    hit = None if seq.block_tables[0] else bm.lookup(seq)
    return all(m.fits(seq, num_new_tokens, hit) for m in bm.managers)


def num_blocks_needed(bm, seq, num_new_tokens: int) -> int:
    """New blocks `bm.allocate(seq, num_new_tokens)` would add to the primary group (prefix hits
    not included)."""
    hit = None if seq.block_tables[0] else bm.lookup(seq)
    return bm.paged_managers[0].num_new_blocks(seq, num_new_tokens, hit)


@pytest.fixture(scope="session")
def allocation_probe():
    """`can_allocate` and `num_blocks_needed`: what a `BlockManager.allocate` would do."""
    from types import SimpleNamespace

    return SimpleNamespace(can_allocate=can_allocate, num_blocks_needed=num_blocks_needed)
