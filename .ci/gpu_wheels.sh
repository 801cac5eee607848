#!/usr/bin/env bash
# Download the web-stack wheels (and xgrammar, for structured outputs; msgspec, for the engine) that the GPU machines' Python (3.12, torch, no network) lacks
# into .whl/ (ignored through .git/info/exclude), for `kvserve serve` there: .ci/gpu_session.sh
# installs them with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`.
# Versions are those of this checkout's .venv (what the tests ran with), else the pins below.
# The GPU image already has anyio, click, h11, httpx, jinja2, prometheus-client, uvloop,
# numpy, transformers, tokenizers, safetensors, triton and matplotlib.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo '/.whl/' >> .git/info/exclude; }

PINS=(
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.3 pydantic-core==2.50.4 pydantic-settings==2.16.3
  python-dotenv==1.2.4 uvicorn==0.54.0 httptools==0.9.0 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2   # structured outputs
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1  # its tests
  msgspec==0.22.0   # the engine's process wire: every stage imports it
  peft==0.21.2 accelerate==1.15.0   # the lora stage writes its adapters with peft
)
wanted=()
for pin in "${PINS[@]}"; do
  name=${pin%%==*}
  version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))" 2>/dev/null || true)
  wanted+=("$name==${version:-${pin#*==}}")
done

rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${wanted[@]}"
ls -l .whl
du -sh .whl
