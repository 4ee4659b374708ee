"""Validates what `deploy/` ships, as CI does (`scripts/check_deploy.sh` installs the tools):

1. the Helm chart `deploy/helm/tandem` is linted (strict) and rendered with its default values,
   the disaggregated values and a values set that turns every option on (mTLS Secrets made from
   PEM values, tokens, ServiceMonitor, InferencePool); every rendered object of a built-in kind
   passes `kubernetes-validate --strict` (custom resources, which it has no schema for, are
   checked for their kind and apiVersion only);
2. the plain manifests in `deploy/k8s/` pass `kubernetes-validate --strict`;
3. the Envoy configuration passes `envoy --mode validate`;
4. every Dockerfile passes hadolint with no finding at all (the `info` threshold).

Rendering uses Helm's own engine (the `helm-python-sdk` wheel), so no helm binary is needed.
Exits non-zero on the first failing step.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from helm_python.chart import Chart, lint, values_from_yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "tandem"
BIN = Path(sys.executable).parent
# Custom resources the chart may render: kubernetes-validate has no schema for them.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"),
                ("inference.networking.k8s.io/v1", "InferencePool")}
PLACEHOLDER_PEM = "-----BEGIN CERTIFICATE-----\nplaceholder\n-----END CERTIFICATE-----\n"
EVERY_OPTION = {
    "tls": {"enabled": True, "create": True, "requireClientCert": True,
            "pem": {k: PLACEHOLDER_PEM for k in ("ca", "frontendCert", "frontendKey", "engineCert", "engineKey",
                                                  "frontendClientCert", "frontendClientKey")}},
    "auth": {"clientTokenSecret": "tandem-client-token", "engineTokenSecret": "tandem-engine-token"},
    "model": {"hfTokenSecret": "hf-token"},
    "serviceMonitor": {"enabled": True},
    "inferencePool": {"enabled": True},
    "networkPolicy": {"frontendIngressFrom": [{"namespaceSelector": {"matchLabels": {"name": "gateway"}}}]},
}


def run(argv: list[str]) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True)


def render(name: str, values: dict | None, out: Path) -> Path:
    """The chart rendered with `values` into one multi-document file; custom resources apart."""
    manifests = Chart.load(CHART).render(values=values, name="tandem", namespace="llm", is_install=True)
    builtin, custom = [], []
    for text in manifests.values():
        for doc in yaml.safe_load_all(text):
            if not doc:
                continue
            kind = (doc.get("apiVersion"), doc.get("kind"))
            (custom if kind in CUSTOM_KINDS else builtin).append(doc)
            if kind not in CUSTOM_KINDS and kind[1] in {k for _, k in CUSTOM_KINDS}:
                raise SystemExit(f"{name}: {kind[1]} with an unexpected apiVersion {kind[0]}")
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(builtin, sort_keys=False))
    kinds = sorted({d["kind"] for d in builtin} | {d["kind"] for d in custom})
    print(f"{name}: {len(builtin) + len(custom)} objects ({', '.join(kinds)})")
    return path


def main() -> int:
    report = lint(str(CHART), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    if problems:
        raise SystemExit(f"helm lint: {problems}")
    disaggregated = values_from_yaml((CHART / "values-disaggregated.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        files = [render("default", None, out), render("disaggregated", disaggregated, out),
                 render("every-option", EVERY_OPTION, out)]
        run([str(BIN / "kubernetes-validate"), "--strict", "--quiet", *map(str, files)])
    run([str(BIN / "kubernetes-validate"), "--strict", "--quiet", *map(str, sorted((REPO / "deploy" / "k8s").glob("*.yaml")))])
    run([str(BIN / "envoy"), "--mode", "validate", "-l", "warning", "-c", str(REPO / "deploy" / "mesh" / "envoy.yaml")])
    for dockerfile in sorted(REPO.glob("deploy/**/Dockerfile*")):
        run([str(BIN / "hadolint"), "--no-color", "--failure-threshold", "info", str(dockerfile)])
    print("deploy checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
