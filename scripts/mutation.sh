#!/usr/bin/env bash
# Mutation testing of one module against its fast unit tests, with mutmut 3 (the dev extra
# installs it). mutmut 3 copies the sources into mutants/ and puts that folder first on sys.path;
# it finds modules by path from its working folder, so each run works in .mutation/<module>/, which
# holds a copy of the module's distribution source root (`tandem/...`, folder = import path) and a
# pyproject.toml naming the one file to mutate and its tests.
#
#   bash scripts/mutation.sh block_manager      # or: scheduler sampler stopping stops request_ids detokenizer
#   (cd .mutation/block_manager && ../../.venv/bin/mutmut results)   # survivors
#   (cd .mutation/block_manager && ../../.venv/bin/mutmut show <name>)  # the diff of one mutant
#
# Extra arguments go to `mutmut run` (e.g. a mutant name or glob to re-run).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
export TANDEM_CACHE_DIR="${TANDEM_CACHE_DIR:-$HOME/.cache/tandem}"
case "${1:?module: block_manager scheduler sampler stopping stops request_ids detokenizer}" in
  block_manager) dist=engine_service; path=tandem/engine_service/cache/block_manager.py
                 tests="tests/unit/test_block_manager.py tests/unit/test_scheduler.py" ;;
  scheduler)   dist=engine_service; path=tandem/engine_service/core/scheduler.py
               tests="tests/unit/test_scheduler.py tests/unit/test_overlap_scheduling.py" ;;
  sampler)     dist=engine_service; path=tandem/engine_service/worker/sampler.py; tests="tests/unit/test_sampler.py" ;;
  stopping)    dist=engine_service; path=tandem/engine_service/core/stopping.py; tests="tests/unit/test_stopping.py" ;;
  stops)       dist=frontend; path=tandem/frontend/stops.py;       tests="tests/unit/test_stops.py" ;;
  request_ids) dist=frontend; path=tandem/frontend/request_ids.py; tests="tests/unit/test_request_ids.py" ;;
  detokenizer) dist=frontend; path=tandem/frontend/detokenizer.py; tests="tests/unit/test_detokenizer.py" ;;
  *) echo "unknown module $1" >&2; exit 2 ;;
esac
work=.mutation/$1
rm -rf "$work/tandem" "$work/mutants"
mkdir -p "$work"
cp -r "$dist/tandem" "$work/tandem"
find "$work/tandem" -name __pycache__ -prune -exec rm -rf {} +
{
  echo "[tool.mutmut]"
  echo "source_paths = [\"tandem\"]"
  echo "only_mutate = [\"$path\"]"
  printf 'pytest_add_cli_args_test_selection = ['; for t in $tests; do printf '"%s", ' "$repo/$t"; done; echo ']'
  echo "pytest_add_cli_args = [\"-p\", \"no:cacheprovider\", \"--import-mode=importlib\", \"--timeout=120\"]"
} > "$work/pyproject.toml"
cd "$work"
exec "$repo/.venv/bin/mutmut" run "${@:2}"
