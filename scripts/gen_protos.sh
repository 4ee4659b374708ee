#!/usr/bin/env bash
# Regenerates protos/tandem/v1/*_pb2*.py from the .proto files. A generated file that differs from
# the committed one only in the generator's version stamp (GRPC_GENERATED_VERSION) is left as
# committed, so that set-up does not dirty a fresh clone.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" protos/tandem/v1/*.proto
unstamped() { grep -v '^GRPC_GENERATED_VERSION = ' "$1"; }
for generated in "$out"/tandem/v1/*; do
  committed=protos/tandem/v1/$(basename "$generated")
  if [ -f "$committed" ] && cmp -s <(unstamped "$generated") <(unstamped "$committed"); then
    continue
  fi
  cp "$generated" "$committed"
done
