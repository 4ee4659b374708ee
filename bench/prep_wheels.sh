#!/usr/bin/env bash
# Fills the ignored .whl/ with what the GPU machine lacks, so `bench/run_gpu.sh` installs
# everything from there (no network on that machine): the shared device-prep wheels (structlog,
# gguf, grpcio 1.85.1, health checking, reflection) and a wheel of this project, plus msgspec and
# pyzmq at the versions of this checkout's .venv (the engine core's transport; without them every
# part fails at its first import). Run here, from the repository root, after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/tools/device-prep
# msgspec and pyzmq: the engine core's transport; llguidance: structured output (imported by the
# engine's sequence state); OpenTelemetry: tracing (the API everywhere, the SDK and exporter when
# --otlp-endpoint is given). The device image has grpcio, protobuf and typing-extensions.
for pkg in msgspec pyzmq llguidance opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions \
    opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common \
    opentelemetry-proto googleapis-common-protos; do
  version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$pkg'))")
  rm -f .whl/"${pkg}"-*.whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 -d .whl "$pkg==$version"
done
# The commit the GPU machine runs (its own .git copy can be a stale snapshot): run_gpu.sh exports it
# as TANDEM_GIT_COMMIT, which every result records.
echo "$(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!bench/results' || echo -dirty)" > .whl/COMMIT
ls .whl
