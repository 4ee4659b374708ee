#!/usr/bin/env bash
# Mutation testing of one core module against its fast unit tests (mutmut 2.x, which mutates the
# file in place and runs the test command for each mutant; the dev extra installs it).
#
#   bash scripts/mutation.sh kv_cache          # or: scheduler sampler stopping stops request_ids detokenizer
#   .venv/bin/mutmut results                   # survivors; `.venv/bin/mutmut show <id>` for a diff
#
# Run it in a checkout nobody else is testing from at the same time (mutants are written into the
# source file while a test runs; mutmut restores the file at the end, also on Ctrl-C). One module
# per run: mutmut keeps its results in .mutmut-cache, keyed by file, so runs accumulate.
set -euo pipefail
cd "$(dirname "$0")/.."
export TANDEM_CACHE_DIR="${TANDEM_CACHE_DIR:-$HOME/.cache/tandem}"
PYTEST=".venv/bin/python -m pytest -q -x -p no:cacheprovider --timeout 120"
case "${1:?module: kv_cache scheduler sampler stopping stops request_ids detokenizer}" in
  kv_cache)    path=engine_service/kv_cache.py;  tests="tests/unit/test_block_manager.py tests/unit/test_scheduler.py" ;;
  scheduler)   path=engine_service/scheduler.py; tests="tests/unit/test_scheduler.py tests/unit/test_overlap_scheduling.py --deselect tests/unit/test_overlap_scheduling.py::test_padded_graph_buffers_read_pending_tokens" ;;
  sampler)     path=engine_service/sampler.py;   tests="tests/unit/test_sampler.py" ;;
  stopping)    path=engine_service/stopping.py;  tests="tests/unit/test_stopping.py" ;;
  stops)       path=frontend/stops.py;           tests="tests/unit/test_stops.py" ;;
  request_ids) path=frontend/request_ids.py;     tests="tests/unit/test_request_ids.py" ;;
  detokenizer) path=frontend/detokenizer.py;     tests="tests/unit/test_detokenizer.py" ;;
  *) echo "unknown module $1" >&2; exit 2 ;;
esac
exec .venv/bin/mutmut run --paths-to-mutate "$path" --tests-dir tests/unit \
  --runner "$PYTEST $tests" --no-progress "${@:2}"
