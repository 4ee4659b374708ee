#!/usr/bin/env bash
# Regenerates protos/tandem/v1/*_pb2*.py from the .proto files. A regenerated file keeps the
# committed one's version stamp (GRPC_GENERATED_VERSION, the oldest grpcio its stubs accept): a
# newer grpcio-tools here must not raise that floor, or the GPU machine's carried grpcio (1.85.1,
# bench/prep_wheels.sh) refuses to import the stubs; and set-up leaves a fresh clone clean.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" protos/tandem/v1/*.proto
unstamped() { grep -v '^GRPC_GENERATED_VERSION = ' "$1"; }
for generated in "$out"/tandem/v1/*; do
  committed=protos/tandem/v1/$(basename "$generated")
  if [ -f "$committed" ]; then
    if cmp -s <(unstamped "$generated") <(unstamped "$committed"); then
      continue
    fi
    stamp=$(grep -m1 '^GRPC_GENERATED_VERSION = ' "$committed" || true)
    if [ -n "$stamp" ]; then
      sed -i "s/^GRPC_GENERATED_VERSION = .*/$stamp/" "$generated"
    fi
  fi
  cp "$generated" "$committed"
done
