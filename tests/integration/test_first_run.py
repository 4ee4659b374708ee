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
    answers = []
    for _ in range(20):
        out = _tandem(["chat", QUESTION, "--address", first_run["address"]], timeout=600)
        assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr
        assert out.returncode == 0, out.stderr
        answers.append(out.stdout.strip())
    assert sum("Paris" in a for a in answers) >= 18, answers
    lines = first_run["stdout"].read_text().splitlines()
    ready = [line for line in lines if line.startswith("Tandem is ready")]
    assert len(ready) == 1 and first_run["address"] in ready[0], lines


def test_model_info_reports_the_effective_sampling_defaults(first_run):
    from tandem.client import TandemClient

    with TandemClient(first_run["address"]) as client:
        info = client.utility("model_info")
    defaults = info["sampling_defaults"]
    assert defaults["temperature"] == 0.0 and defaults["source"].startswith("shipped")
    assert defaults["max_tokens"] == 256 and defaults["top_p"] == 1.0


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
        assert client.utility("model_info")["sampling_defaults"]["temperature"] == pytest.approx(0.7)
        greedy = {client.chat(messages, temperature=0.0, seed=s, max_tokens=12).choices[0].text for s in range(4)}
        sampled = {client.chat(messages, seed=s, max_tokens=12).choices[0].text for s in range(6)}
    assert len(greedy) == 1 and "Paris" in greedy.pop()
    assert len(sampled) > 1  # without the field, the model's 0.7 samples
