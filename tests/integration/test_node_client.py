"""Production hardening, acceptance 2: a client in another language (Node.js, @grpc/grpc-js,
contract loaded from protos/ at run time) drives the frontend through every conformance check."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"
# Every check conformance.js must report as passed; a check that silently disappears fails here.
EXPECTED_CHECKS = {"generate", "stream", "deadline", "cancel", "invalid_argument", "optional_presence",
                   "control_plane", "structured_output"}


@pytest.mark.parametrize("defaults", ["model", "none"])
def test_node_client_conformance(defaults, serve, launch_serve):
    # Against a default `tandem serve` (the embedded model's greedy defaults) and against neutral
    # sampling defaults, where an unset temperature samples and a dropped field would show.
    if defaults == "model":
        frontend = serve["frontend"]
    else:
        _, frontend, _ = launch_serve(["--generation-config", "none"])
    node = shutil.which("node")
    assert node, "node is not on PATH: Node.js 18+ is needed for clients/node"
    assert (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), (
        "clients/node/node_modules is missing: run `npm ci` in clients/node (scripts/setup.sh does)"
    )
    out = subprocess.run(
        [node, str(NODE_DIR / "conformance.js"), frontend],
        cwd=NODE_DIR, capture_output=True, text=True, timeout=400,
    )
    results = {}
    for line in out.stdout.splitlines():
        record = json.loads(line)  # every stdout line is JSON; anything else is a bug in the script
        if "check" in record:
            results[record["check"]] = record
    report = f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert set(results) == EXPECTED_CHECKS, report
    failed = {name: r.get("error") for name, r in results.items() if not r["ok"]}
    assert not failed, report
    # The embedded model's defaults are greedy; `--generation-config none` samples.
    assert results["optional_presence"]["detail"]["greedy_defaults"] is (defaults == "model"), report
    assert out.returncode == 0, report
