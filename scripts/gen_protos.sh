#!/usr/bin/env bash
# Regenerates protos/tandem/v1/*_pb2*.py from the .proto files (checked for staleness in tests).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos --grpc_python_out=protos protos/tandem/v1/*.proto
