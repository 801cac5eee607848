#!/bin/sh
# Install kvserve into a virtual environment: the one install recipe that both
# images RUN and that tests/test_docker_live.py runs on a dev machine (no Docker
# needed), so what the test checks is what the images do.
#
#   install.sh deps    VENV PROJECT_DIR   # slow, cached layer: Python deps only
#   install.sh package VENV PROJECT_DIR   # kvserve itself, no dependencies
#   install.sh kernels VENV OUT_DIR       # compile the CPU kernels into OUT_DIR
#
# `deps` reads only PROJECT_DIR/pyproject.toml and PROJECT_DIR/docker/constraints.txt,
# so a Dockerfile can run it before copying the source and keep the layer
# across source edits. Which packages come from pyproject.toml ([project]
# dependencies, the `server` and `gguf` extras, [build-system] requires); which versions
# come from docker/constraints.txt, which pins every one of them and their
# dependencies (tests/test_docker.py checks that nothing is left unpinned).
#
# Environment:
#   TORCH_INDEX_URL  index that torch (and nothing else) comes from, e.g.
#                    https://download.pytorch.org/whl/cpu or .../whl/cu130.
#                    Empty: pip's own configuration decides (the tests use this).
#   TORCH_FIND_LINKS a directory of wheels (or a page of links) to take torch
#                    from instead of any index; relative paths are taken from
#                    PROJECT_DIR. Wins over TORCH_INDEX_URL.
#   PYTHON           interpreter that creates the venv (default: python3).
set -eu

usage() {
    echo "usage: $0 deps|package VENV PROJECT_DIR, or $0 kernels VENV OUT_DIR" >&2
    exit 2
}

[ "$#" -eq 3 ] || usage
phase=$1
venv=$2
project=$3
constraints="$project/docker/constraints.txt"
pip="$venv/bin/python -m pip"

case "$phase" in
deps)
    "${PYTHON:-python3}" -m venv "$venv"
    $pip install --upgrade --constraint "$constraints" pip

    # torch first and alone: its index hosts torch builds for one device
    # (cpu, cu130, ...), and --no-deps keeps every other package on PyPI.
    torch_pin=$(grep -E '^torch==' "$constraints")
    if [ -n "${TORCH_FIND_LINKS:-}" ]; then
        links=$TORCH_FIND_LINKS
        case "$links" in
        /* | *://*) ;;
        *) links="$project/$links" ;;
        esac
        $pip install --no-deps --no-index --find-links "$links" "$torch_pin"
    elif [ -n "${TORCH_INDEX_URL:-}" ]; then
        $pip install --no-deps --index-url "$TORCH_INDEX_URL" "$torch_pin"
    else
        $pip install --no-deps "$torch_pin"
    fi

    # Everything else, pinned. Listing torch again makes pip install torch's
    # own dependencies (for a CUDA build: the nvidia-* and triton wheels)
    # while keeping the build installed above, which satisfies the pin.
    requirements="$venv/kvserve-requirements.txt"
    "$venv/bin/python" - "$project/pyproject.toml" >"$requirements" <<'EOF'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    pyproject = tomllib.load(f)
reqs = pyproject["project"]["dependencies"]
reqs += pyproject["project"]["optional-dependencies"]["server"]
reqs += pyproject["project"]["optional-dependencies"]["gguf"]  # GGUF files (models/gguf_loader.py)
reqs += pyproject["build-system"]["requires"]  # so `package` needs no build isolation
print("\n".join(reqs))
EOF
    $pip install --constraint "$constraints" --requirement "$requirements" "$torch_pin"
    rm -f "$requirements"
    ;;
package)
    # No build isolation: the build backend is the pinned one installed by `deps`.
    $pip install --no-deps --no-build-isolation "$project"
    $pip check
    ;;
kernels)
    # The installed package's models/csrc, built where kvserve will look for
    # it (KVSERVE_CPU_OPS_DIR, in folders named by the sources' digests): the
    # host library and every kernel set of this architecture (avx512,
    # avx512vnni and avx2 on x86-64, neon on ARM64), so the image runs fast on any CPU, not only the
    # builder's. Fails loudly: an image that silently fell back to the PyTorch
    # path would be slower with nothing to say why.
    out=$3
    mkdir -p "$out"
    case "$(uname -m)" in
    x86_64 | amd64 | aarch64 | arm64) ;;
    *)
        echo "no CPU kernels on $(uname -m): kvserve runs its PyTorch path"
        exit 0
        ;;
    esac
    KVSERVE_CPU_OPS_DIR=$out "$venv/bin/python" -c \
        "from kvserve.models import cpu_ops; print('kernel sets:', *cpu_ops.build_all())"
    # Only the libraries are loaded: drop anything else a build left.
    find "$out" -type f ! -name '*.so' -delete
    ;;
*)
    usage
    ;;
esac
