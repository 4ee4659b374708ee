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
# Two workers, one test file each at a time (a file's module-scoped servers stay in one worker),
# files in collection order (tests/conftest.py starts the longest first): most integration time
# is spent waiting on servers, so two files overlap well even on two cores. One OpenMP thread per
# process: two workers' processes on two cores each spinning two threads wait on each other.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# --durations: the 15 slowest tests close the log (docs/testing.md keeps the list).
exec .venv/bin/pytest -q -n "${TANDEM_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=15 "$@"
