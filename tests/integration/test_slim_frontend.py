"""The frontend side installs and serves without torch: a venv with only the protos, the shared
runtime and the frontend distributions answers a chat through an engine started from the full
install (the slim frontend image's promise, docs/architecture.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _pinned_constraints(path: Path) -> Path:
    """The full install's versions, so the slim venv resolves what CI already tested."""
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True,
                            capture_output=True, text=True).stdout
    path.write_text("".join(line + "\n" for line in frozen.splitlines() if "==" in line))
    return path


@pytest.fixture(scope="module")
def slim_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("slim") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = _pinned_constraints(venv.parent / "constraints.txt")
    # Built from copies: an in-tree build would leave build/ and *.egg-info folders in the checkout.
    sources = [shutil.copytree(REPO / dist, venv.parent / "src" / dist, ignore=shutil.ignore_patterns(
        "__pycache__", "build", "*.egg-info")) for dist in ("protos", "common", "frontend")]
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "-c", str(constraints), *map(str, sources)], check=True, timeout=900)
    return venv


def test_slim_venv_has_neither_torch_nor_the_engine(slim_venv):
    for module in ("torch", "tandem.engine_service", "tandem.kernels"):
        r = subprocess.run([str(slim_venv / "bin" / "python"), "-P", "-c", f"import {module}"], capture_output=True,
                           text=True, cwd="/")
        assert r.returncode != 0 and "No module named" in r.stderr, (module, r.stderr[-300:])


def test_slim_venv_has_what_tracing_needs(slim_venv):
    # --otlp-endpoint loads the OpenTelemetry SDK and its OTLP/gRPC exporter (tandem.tracing).
    code = ("from tandem.tracing import Tracing; import opentelemetry.sdk.trace; "
            "import opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
    r = subprocess.run([str(slim_venv / "bin" / "python"), "-P", "-c", code], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr[-2000:]


def test_slim_frontend_serves_a_chat_against_a_full_engine(slim_venv, smollm2_dir, server_tools):
    ServerProcess, free_port, wait_serving = server_tools.ServerProcess, server_tools.free_port, server_tools.wait_serving
    eport, fport = free_port(), free_port()
    engine = ServerProcess(["engine", "--host", "127.0.0.1", "--port", str(eport)])  # the full install
    tandem = str(slim_venv / "bin" / "tandem")
    frontend = subprocess.Popen([tandem, "frontend", "--host", "127.0.0.1", "--port", str(fport),
                                 "--engine", f"127.0.0.1:{eport}", "--tokenizer", str(smollm2_dir)], cwd="/")
    try:
        wait_serving(f"127.0.0.1:{eport}", "tandem.v1.Engine", 300, engine.proc)
        wait_serving(f"127.0.0.1:{fport}", "tandem.v1.Frontend", 120, frontend)
        r = subprocess.run([tandem, "chat", "--address", f"127.0.0.1:{fport}", "What is the capital of France?"],
                           capture_output=True, text=True, timeout=120, cwd="/")
        assert r.returncode == 0, r.stderr[-2000:]
        assert "Paris" in r.stdout
    finally:
        frontend.terminate()
        frontend.wait(60)
        engine.stop()
