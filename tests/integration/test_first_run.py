"""Issue #9: a new user's first run.

1. `tandem serve` from a clean cache directory, then at once `tandem chat "What is the capital
   of France?"` with no sampling flags, 20 times: at least 18 answers contain "Paris", no
   command prints a traceback, and `serve` prints one ready line with the address.
2. Each start-up error (bad --model, a port in use, an unreachable --engine, an unreadable
   certificate) exits non-zero with exactly one line on stderr naming the flag (console
   format), one JSON record in JSON format, and a traceback only with --log-level debug.
3. A request's explicit temperature 0 beats a model default of 0.7 from generation_config.json.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

QUESTION = "What is the capital of France?"


def _tandem(args: list[str], timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "tandem.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd="/", env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, get_free_port):
    """`tandem serve` with an empty TANDEM_CACHE_DIR (the embedded model is converted again),
    its stdout kept to check the ready line."""
    cache = tmp_path_factory.mktemp("clean-cache")
    out = tmp_path_factory.mktemp("serve") / "stdout.txt"
    port, engine_port = get_free_port(), get_free_port()
    env = {**os.environ, "TANDEM_CACHE_DIR": str(cache), "TANDEM_LOG_LEVEL": "warning"}
    with open(out, "wb") as stdout:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "tandem.cli", "serve", "--host", "127.0.0.1",
                                 "--port", str(port), "--engine-port", str(engine_port)],
                                env=env, cwd="/", stdout=stdout, stderr=subprocess.DEVNULL)
    yield {"address": f"127.0.0.1:{port}", "proc": proc, "stdout": out, "env": env}
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_chat_right_after_serve_answers_paris_without_tracebacks(first_run):
    def chat(_=None) -> str:
        out = _tandem(["chat", QUESTION, "--address", first_run["address"]], timeout=600)
        assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    # The first chat waits for the server to finish starting; the other 19 come four at a time.
    with ThreadPoolExecutor(4) as pool:
        answers = [chat(), *pool.map(chat, range(19))]
    assert sum("Paris" in a for a in answers) >= 18, answers
    lines = first_run["stdout"].read_text().splitlines()
    ready = [line for line in lines if line.startswith("Tandem is ready")]
    assert len(ready) == 1 and first_run["address"] in ready[0], lines


def test_model_info_reports_the_effective_sampling_defaults(first_run):
    from tandem.client import TandemClient

    with TandemClient(first_run["address"]) as client:
        info = client.model_info()
    defaults = info.sampling_defaults
    assert defaults.HasField("temperature") and defaults.temperature == 0.0
    assert info.sampling_defaults_source.startswith("shipped")
    assert defaults.max_tokens == 256 and defaults.top_p == 1.0


def test_client_without_a_server_says_where_it_looked_in_one_line(get_free_port):
    address = f"127.0.0.1:{get_free_port()}"
    out = _tandem(["--log-format", "console", "chat", "hi", "--address", address, "--wait", "1"])
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert address in lines[0] and "tandem serve" in lines[0]


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def closed_port():
    with socket.socket() as s:  # bound but not listening: connections are refused
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def _startup_cases(busy: int, closed: int, tmp_path) -> dict[str, tuple[list[str], str]]:
    unreadable = tmp_path / "cert-dir.pem"
    unreadable.mkdir()
    return {
        "model": (["serve", "--model", "/nonexistent/model"], "--model"),
        "port": (["serve", "--host", "127.0.0.1", "--port", str(busy)], "--port"),
        "engine": (["frontend", "--port", "0", "--engine", f"127.0.0.1:{closed}", "--engine-connect-timeout", "1"],
                   "--engine"),
        "cert": (["serve", "--tls-cert", str(unreadable), "--tls-key", str(unreadable)], "--tls-cert"),
    }


@pytest.mark.parametrize("case", ["model", "port", "engine", "cert"])
def test_startup_error_is_one_line_naming_the_flag(case, busy_port, closed_port, tmp_path):
    argv, flag = _startup_cases(busy_port, closed_port, tmp_path)[case]
    start = time.monotonic()
    out = _tandem(["--log-format", "console", *argv], timeout=60)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert flag in lines[0] and "Traceback" not in out.stderr
    assert time.monotonic() - start < 30  # decided before anything loads

    out = _tandem(["--log-format", "json", *argv], timeout=60)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    record = json.loads(lines[0])
    assert record["level"] == "error" and record["flag"] == flag


def test_traceback_only_with_debug(tmp_path):
    out = _tandem(["--log-format", "console", "--log-level", "debug", "serve", "--model", "/nonexistent/model"])
    assert out.returncode != 0
    assert "Traceback" in out.stderr and "--model /nonexistent/model" in out.stderr.strip().splitlines()[-1]


def test_explicit_temperature_zero_beats_a_model_default_of_0_7(launch_serve, tmp_path):
    from tandem.client import TandemClient

    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"temperature": 0.7, "top_p": 1.0}))
    _, frontend, _ = launch_serve(["--generation-config", str(gen)])
    messages = [{"role": "user", "content": QUESTION}]
    with TandemClient(frontend) as client:
        assert client.model_info().sampling_defaults.temperature == pytest.approx(0.7)
        greedy = {client.chat(messages, temperature=0.0, seed=s, max_tokens=12).choices[0].text for s in range(4)}
        sampled = {client.chat(messages, seed=s, max_tokens=12).choices[0].text for s in range(6)}
    assert len(greedy) == 1 and "Paris" in greedy.pop()
    assert len(sampled) > 1  # without the field, the model's 0.7 samples


# -- issue 22: dummy models that serve, clients that notice a dead server, a clean shutdown -------


def _serve(argv: list[str], out_dir, get_free_port, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`tandem serve` on free loopback ports in its own session (a test's SIGINT to its group is
    a terminal's Ctrl-C); stdout and stderr in files under `out_dir`."""
    port = get_free_port()
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TANDEM_DRAIN_TIMEOUT": "20", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-P", "-m", "tandem.cli", "--log-format", "console", "serve",
                             "--host", "127.0.0.1", "--port", str(port), "--engine-port", "0",
                             "--frontend-workers", "1", *argv],
                            stdout=open(out_dir / "stdout.txt", "wb"), stderr=open(out_dir / "stderr.txt", "wb"),
                            env=full_env, cwd="/", start_new_session=True)
    return proc, f"127.0.0.1:{port}"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("model", ["dummy:qwen3-0.6b", "dummy:tiny-qwen3.5"])
def test_dummy_model_serves_a_chat_with_no_tokenizer_flag_and_no_network(model, tmp_path, get_free_port):
    """dummy:qwen3-0.6b gets the embedded SmolLM2 tokenizer (its vocabulary holds SmolLM2's ids);
    the tiny hybrid a word-level tokenizer of exactly its 320 ids, so a text chat is in range."""
    from tandem.client import TandemClient

    proc, address = _serve(["--model", model, "--max-model-len", "256"], tmp_path, get_free_port)
    try:
        with TandemClient(address) as client:
            client.wait_ready(240, progress=None)
            reply = client.chat([{"role": "user", "content": "Hello there"}], max_tokens=4, temperature=0)
        assert reply.choices[0].finish_reason != 0 and reply.usage.completion_tokens >= 1
        # Which tokenizer each dummy gets: tests/unit/test_tokenizer_files.py.
    finally:
        _stop(proc)


def test_a_client_gives_up_within_5s_of_its_server_dying(tmp_path, get_free_port):
    """A chat waiting on a server that answered "starting" and then exited reports that within
    5 s, not after its whole --wait, and does not advise waiting longer."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    port = get_free_port()
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("tandem.v1.Frontend", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    chat = subprocess.Popen([sys.executable, "-P", "-m", "tandem.cli", "--log-format", "console", "chat", "hi",
                             "--address", f"127.0.0.1:{port}", "--wait", "300"],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        time.sleep(4)  # the client has seen the server answer "not serving"
        server.stop(0)
        died = time.monotonic()
        _, err = chat.communicate(timeout=30)
        assert time.monotonic() - died < 5
    finally:
        if chat.poll() is None:
            chat.kill()
    assert chat.returncode == 3
    last = err.strip().splitlines()[-1]
    assert "stopped while starting" in last and "--wait" not in last, err
    assert "waiting for the Tandem server" in err  # the progress line while it was starting


def test_ctrl_c_on_disaggregated_serve_mid_request_drains_and_exits_0(tmp_path, get_free_port):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while a request streams:
    the request finishes, `draining`/`drained` are logged once, nothing reports an engine exit,
    no traceback, exit 0. A second Ctrl-C stops at once with a line saying so (exit 130)."""
    from tandem.client import TandemClient

    for second in (False, True):
        out = tmp_path / ("twice" if second else "once")
        out.mkdir()
        proc, address = _serve(["--model", "dummy:tiny-qwen3", "--disaggregated"], out, get_free_port)
        try:
            with TandemClient(address) as client:
                client.wait_ready(180, progress=None)
                call = client.stream("t1 t2 t3", max_tokens=400, ignore_eos=True, temperature=0)
                next(call)
                os.killpg(proc.pid, signal.SIGINT)
                if second:
                    time.sleep(0.3)
                    os.killpg(proc.pid, signal.SIGINT)
                    with pytest.raises(Exception):
                        list(call)
                else:
                    tokens = sum(len(c.token_ids) for msg in call for c in msg.choices)
                    assert tokens > 0
            assert proc.wait(60) == (130 if second else 0)
        finally:
            _stop(proc)
        err = (out / "stderr.txt").read_text()
        assert "Traceback" not in err and "CancelledError" not in err and "exited with code" not in err, err
        assert "engine_subscription_lost" not in err
        if second:
            assert "stopping_now" in err
        else:
            assert err.count("draining") == 1 and err.count("drained") == 1, err


@pytest.mark.parametrize("argv,flag", [
    (["--port", "70000"], "--port"),
    (["--kv-lease-seconds", "inf"], "--kv-lease-seconds"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--tokenizer", "/nonexistent/tokenizer"], "--tokenizer"),
    (["--tls-cert", "GARBAGE", "--tls-key", "GARBAGE"], "--tls-cert"),
])
def test_a_bad_flag_value_exits_2_in_one_line_before_anything_loads(argv, flag, tmp_path):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n")
    argv = [str(garbage) if a == "GARBAGE" else a for a in argv]
    start = time.monotonic()
    out = _tandem(["--log-format", "console", "serve", "--model", "dummy:tiny-qwen3", *argv], timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in out.stderr, out.stderr
    assert time.monotonic() - start < 20  # decided before any model loads


def test_frontend_engine_address_out_of_range_and_nan_timeout_exit_2_at_once():
    for argv, flag in ((["--engine", "127.0.0.1:99999"], "--engine"),
                       (["--engine-connect-timeout", "nan"], "--engine-connect-timeout")):
        start = time.monotonic()
        out = _tandem(["--log-format", "console", "frontend", "--port", "0", *argv], timeout=30)
        assert out.returncode == 2 and flag in out.stderr and len(out.stderr.strip().splitlines()) == 1
        assert time.monotonic() - start < 10
