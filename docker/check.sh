#!/usr/bin/env bash
# Build a kvserve image with buildah (no Docker daemon needed) and check it for real.
#
#   docker/check.sh          # CPU image: build docker/Dockerfile.cpu, run it as its
#                            # ENTRYPOINT/USER/ENV say, check it (docker/check_image.py),
#                            # including Prometheus on every query of the Grafana dashboard
#   docker/check.sh --gpu    # GPU image: build docker/Dockerfile up to its last step on a
#                            # stand-in base with the CUDA base's Python (no GPU, no CUDA)
#
# Needs root (or a user buildah can run for), buildah, and for the stand-in base
# debootstrap; for the Prometheus check, Debian's prometheus package. On Debian/Ubuntu:
#   apt-get install buildah debootstrap prometheus
# Where buildah cannot run, it says so and runs the CPU image's install recipe into a fresh venv
# instead (tests/test_docker_live.py -m image); for --gpu it checks nothing and exits 0.
#
# Base images: pulled where a registry answers; otherwise made from Debian packages
# (debootstrap + the distribution's Python) and tagged locally. Python packages come
# from whatever pip on this machine is configured with: its configuration, the files
# it names (CA bundle, wheel folders, local indexes) are mounted into the build's RUN
# steps, and a torch wheel found in its wheel folders is used through the Dockerfile's
# TORCH_FIND_LINKS (docker/wheels/).
#
# Environment: KVSERVE_CHECK_DIR (work folder: image storage, logs; default a new
# temporary folder, removed at the end unless KVSERVE_CHECK_KEEP=1),
# KVSERVE_CHECK_CACHE (where the stand-in bases are kept between runs; default
# ~/.cache/kvserve/check), KVSERVE_CHECK_BASE=pull|standin (skip the pull, or insist on it).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
target=cpu
case "${1:-}" in
"") ;;
--gpu) target=gpu ;;
*)
    echo "usage: $0 [--gpu]" >&2
    exit 2
    ;;
esac

say() { echo "docker/check.sh: $*"; }
# Without buildah the CPU image's recipe still runs: its builder steps into a fresh venv, then its
# ENTRYPOINT with its ENV (tests/test_docker_live.py, `-m image`), with the repository's Python.
skip() {
    local py=${PYTHON:-$repo/.venv/bin/python}
    if [ "$target" = cpu ] && [ -x "$py" ] && "$py" -c "import pytest" 2>/dev/null; then
        say "$*: running the CPU image's install recipe instead (pytest -m image tests/test_docker_live.py)"
        cd "$repo" && exec "$py" -m pytest -q -m image tests/test_docker_live.py
    fi
    say "SKIPPED, nothing was checked: $*"
    exit 0
}

command -v buildah >/dev/null || skip "buildah not found (apt-get install buildah debootstrap prometheus)"

work=${KVSERVE_CHECK_DIR:-$(mktemp -d "${TMPDIR:-/var/tmp}/kvserve-check.XXXXXX")}
cache=${KVSERVE_CHECK_CACHE:-$HOME/.cache/kvserve/check}
mkdir -p "$work" "$cache"
copied_wheel=""
cleanup() {
    [ -n "$copied_wheel" ] && rm -f "$copied_wheel"
    if [ "${KVSERVE_CHECK_KEEP:-0}" != 1 ]; then
        # vfs layers are plain folders (some read-only to their owner): unmount, then remove
        bh rm --all >/dev/null 2>&1 || true
        chmod -R u+w "$work" 2>/dev/null || true
        rm -rf "$work"
    fi
}
trap cleanup EXIT

bh() { buildah --root "$work/storage" --runroot "$work/run" --storage-driver vfs "$@"; }
bh info >/dev/null 2>&1 || skip "buildah cannot run here: $(bh info 2>&1 | tail -1)"

seconds() { echo $(($(date +%s) - $1)); }

# ---- base image: the real one, or a stand-in from distribution packages ----
# stand_in NAME SUITE MIRROR [PYTHON]: a minimal SUITE from MIRROR, with PYTHON (python3.X)
# as the image's python/python3 when given, tagged NAME, kept as a tarball in the cache.
stand_in() {
    local name=$1 suite=$2 mirror=$3 python=${4:-}
    local tarball="$cache/$suite${python:+-$python}.tar"
    if [ ! -s "$tarball" ]; then
        command -v debootstrap >/dev/null || skip "cannot pull the base image and debootstrap is not installed"
        local rootfs="$work/rootfs-$suite" script="" components=main
        if [ ! -e "/usr/share/debootstrap/scripts/$suite" ]; then
            # Ubuntu: Debian 12's debootstrap predates 24.04 (every Ubuntu suite uses one script),
            # and its images, the CUDA ones included, have universe (python3-venv) enabled
            script=/usr/share/debootstrap/scripts/gutsy
            components=main,restricted,universe,multiverse
        fi
        local t0
        t0=$(date +%s)
        # shellcheck disable=SC2086 # $script: one path or nothing
        debootstrap --variant=minbase --components="$components" --include=ca-certificates \
            "$suite" "$rootfs" "$mirror" $script \
            >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log"; say "debootstrap failed"; exit 1; }
        if [ -n "$script" ]; then # the updates and security pockets, as in Ubuntu's images
            printf 'deb %s %s %s\n' "$mirror" "$suite-updates" "${components//,/ }" \
                "$mirror" "$suite-security" "${components//,/ }" >>"$rootfs/etc/apt/sources.list"
        fi
        if [ -n "$python" ]; then # with apt, which resolves what debootstrap's --include does not
            chroot "$rootfs" sh -c "apt-get update -q && DEBIAN_FRONTEND=noninteractive \
                apt-get install -y -q --no-install-recommends $python $python-venv" >>"$work/debootstrap.log" 2>&1 ||
                { tail -20 "$work/debootstrap.log"; say "installing $python failed"; exit 1; }
        fi
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        if [ -n "$python" ]; then
            ln -sf "/usr/bin/$python" "$rootfs/usr/local/bin/python3"
            ln -sf "/usr/bin/$python" "$rootfs/usr/local/bin/python"
        fi
        tar -C "$rootfs" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
        rm -rf "$rootfs"
        say "stand-in base $suite${python:+ + $python} made in $(seconds "$t0") s"
    fi
    local ctr
    ctr=$(bh from scratch)
    bh add "$ctr" "$tarball" / >/dev/null
    bh config --env PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd "${python:-bash}" "$ctr"
    bh commit --quiet "$ctr" "$name" >/dev/null
    bh rm "$ctr" >/dev/null
}

# base IMAGE STAND_IN_ARGS...: prints the image to build FROM: IMAGE where it can be
# pulled, else a stand-in made by `stand_in STAND_IN_ARGS...`.
base() {
    local image=$1
    shift
    if [ "${KVSERVE_CHECK_BASE:-}" != standin ] && timeout 120 buildah --root "$work/storage" \
        --runroot "$work/run" --storage-driver vfs pull --quiet "$image" >/dev/null 2>&1; then
        echo "$image"
        return
    fi
    [ "${KVSERVE_CHECK_BASE:-}" = pull ] && { say "cannot pull $image" >&2; exit 1; }
    say "cannot pull $image: using a stand-in made from packages" >&2
    stand_in "$@" >&2
    echo "$1"
}

# ---- pip's configuration on this machine, for the build's RUN steps ----
# pip_setup TORCH_BUILD PYTHON_TAG (cpu cp311): mounts, and torch from a local wheel if one is there
mounts=()
torch_args=()
pip_setup() {
    local conf="$work/pip.conf"
    python3 "$repo/docker/check_image.py" pip-config "$conf" >"$work/pip-mounts"
    mounts+=(--volume "$conf:/etc/pip.conf:ro")
    while read -r host inside; do
        mounts+=(--volume "$host:$inside:ro")
    done <"$work/pip-mounts"
    # a torch wheel of the pinned version in pip's wheel folders: build from it
    local pin wheel
    pin=$(grep -E '^torch==' "$repo/docker/constraints.txt" | cut -d= -f3)
    wheel=$(python3 "$repo/docker/check_image.py" find-wheel "torch-$pin+$1-$2-" "$conf")
    if [ -n "$wheel" ]; then
        copied_wheel="$repo/docker/wheels/$(basename "$wheel")"
        [ -e "$copied_wheel" ] && copied_wheel="" # the user's own: leave it
        [ -n "$copied_wheel" ] && { ln "$wheel" "$copied_wheel" 2>/dev/null || cp "$wheel" "$copied_wheel"; }
        torch_args=(--build-arg TORCH_FIND_LINKS=docker/wheels)
        say "torch from $wheel"
    fi
}

build() {
    local dockerfile=$1 tag=$2
    shift 2
    local t0
    t0=$(date +%s)
    say "building $dockerfile (log: $work/build.log)"
    if ! bh bud --isolation chroot --format docker --file "$dockerfile" --tag "$tag" \
        "${mounts[@]}" "${torch_args[@]}" "$@" "$repo" >"$work/build.log" 2>&1; then
        tail -40 "$work/build.log"
        say "FAILED: the build of $dockerfile"
        exit 1
    fi
    say "built $tag in $(seconds "$t0") s"
}

cd "$repo"
if [ "$target" = cpu ]; then
    image_base=$(base docker.io/library/python:3.11.15-slim-bookworm \
        localhost/kvserve-standin/python:3.11-bookworm bookworm http://deb.debian.org/debian python3.11)
    say "base: $image_base"
    pip_setup cpu cp311
    build docker/Dockerfile.cpu localhost/kvserve-check:cpu --build-arg "PYTHON_IMAGE=$image_base"
    python3 docker/check_image.py run --image localhost/kvserve-check:cpu --work "$work" \
        --buildah "buildah --root $work/storage --runroot $work/run --storage-driver vfs"
else
    # The stand-in for the CUDA base is the Ubuntu it is built on, without CUDA; the
    # Dockerfile installs Python 3.12 from Ubuntu's archive on either. torch is the CUDA
    # build from pip's configured index (PyPI's default build: several GB to download).
    # Not checked: the CUDA libraries of the real base, and anything that needs a GPU.
    image_base=$(base docker.io/nvidia/cuda:13.0.2-base-ubuntu24.04 \
        localhost/kvserve-standin/ubuntu:24.04 noble http://archive.ubuntu.com/ubuntu)
    say "base: $image_base"
    pip_setup cu130 cp312
    [ "${#torch_args[@]}" -gt 0 ] || torch_args=(--build-arg TORCH_INDEX_URL=)
    build docker/Dockerfile localhost/kvserve-check:gpu --build-arg "CUDA_BASE_IMAGE=$image_base"
    ctr=$(bh from localhost/kvserve-check:gpu)
    bh run --isolation chroot "$ctr" -- kvserve serve --help >/dev/null
    bh run --isolation chroot "$ctr" -- python -c \
        "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    say "GPU image built on a stand-in base; 'kvserve serve --help' runs in it. Not checked: CUDA, a GPU."
fi
say "OK"
