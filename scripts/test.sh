#!/usr/bin/env bash
# Runs the whole test suite: unit, kernel (Triton interpreter on CPU) and integration tests
# against real gRPC servers with the real embedded model.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1
# Converted models are cached inside the checkout so a fresh clone converts once per run.
export TANDEM_CACHE_DIR="${TANDEM_CACHE_DIR:-$PWD/.cache/models}"
# The layer contracts (pyproject.toml [tool.importlinter]): the frontend imports neither torch nor
# the engine, the engine's rooms import only downwards.
.venv/bin/lint-imports --no-cache
# deploy/: the Helm chart rendered and validated, manifests, Envoy config, Dockerfile lint (a few seconds).
bash scripts/check_deploy.sh
exec .venv/bin/pytest -q "$@"
