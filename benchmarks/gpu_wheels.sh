#!/usr/bin/env bash
# Fill wheels/ (git-ignored, at the repo root) with every wheel the GPU suite and the GPU
# benchmark need that a bare GPU machine without network may lack, for CPython 3.10, 3.11
# and 3.12 on manylinux x86_64. benchmarks/gpu_run.sh installs from that folder offline.
#
#   benchmarks/gpu_wheels.sh            # run where PyPI is reachable, from anywhere
#
# The machine is assumed to have torch (+CUDA), numpy, transformers, accelerate,
# safetensors, tqdm, psutil, py-cpuinfo, aiofiles and ninja; those are not downloaded
# (tqdm, psutil, py-cpuinfo and ninja are, being tiny DeepSpeed requirements).
# DeepSpeed is an sdist: its wheel is built here without ops (DS_BUILD_OPS=0, the ops are
# JIT-compiled on the GPU machine), with PYTHON's torch (default: the repo's .venv).
# DeepSpeed's async_io op (ZeRO-Infinity's NVMe path) needs libaio's header and .so, which the
# GPU image lacks: Debian's libaio1 + libaio-dev .debs (~45 KB, amd64; apt-get download) are
# unpacked into wheels/libaio/{include,lib}, and gpu_run.sh points the compiler there
# (CFLAGS/LDFLAGS for DeepSpeed's is_compatible() probe, CPATH/LIBRARY_PATH for the JIT build's
# -laio, LD_LIBRARY_PATH for loading the built op). Where apt-get is missing it says so and
# goes on: bench_gpu's ZeRO-Infinity row then reads n/a.
# The folder is rebuilt in a staging folder and swapped in only on success, so a rerun is
# safe and leaves no stale versions; pip's HTTP cache makes reruns quick.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
DEST="$ROOT/wheels"
STAGE="$ROOT/wheels.tmp"
LIMIT_MIB=60
PY_VERSIONS=(3.10 3.11 3.12)

# zerotier's runtime and test needs (pyproject.toml) that the machine may lack; tomli is
# for Python 3.10 (zerotier.config); exceptiongroup/tomli are pytest's 3.10 back-ports,
# named explicitly because pip download evaluates markers for the running interpreter;
# pip bootstraps a venv where python3 lacks ensurepip; nvidia-ml-py is what DeepSpeed's
# CUDA accelerator imports (a CUDA build of DeepSpeed requires it; this CPU build does not);
# pytest-timeout stops a stuck test so the rest of the suite still runs (gpu_run.sh --timeout).
BASE_PKGS=(crc32c pytest pytest-timeout iniconfig pluggy packaging pygments exceptiongroup tomli pyyaml
           setuptools wheel pip nvidia-ml-py)

"$PYTHON" -c 'import torch' 2>/dev/null || {
    echo "error: $PYTHON has no torch (needed to build the DeepSpeed wheel); set PYTHON=" >&2
    exit 1
}

rm -rf "$STAGE"
mkdir -p "$STAGE"
trap 'rm -rf "$STAGE"' EXIT
BUILD="$STAGE/.build"
mkdir -p "$BUILD"

echo "== DeepSpeed wheel without ops (built with $("$PYTHON" -c 'import torch; print("torch", torch.__version__)'))"
"$PYTHON" -m pip download --no-deps --no-binary :all: --dest "$BUILD" deepspeed
SDIST="$(ls "$BUILD"/deepspeed-*.tar.gz)"
DS_BUILD_OPS=0 DS_BUILD_AIO=0 DS_BUILD_GDS=0 \
    "$PYTHON" -m pip wheel --no-deps --no-build-isolation --wheel-dir "$BUILD" "$SDIST"
DS_WHEEL="$(ls "$BUILD"/deepspeed-*.whl)"
case "$(basename "$DS_WHEEL")" in
    *-py3-none-any.whl) ;;
    *) echo "error: $(basename "$DS_WHEEL") is not a py3-none-any wheel (ops were compiled?)" >&2; exit 1 ;;
esac
mv "$DS_WHEEL" "$STAGE/"
DS_WHEEL="$STAGE/$(basename "$DS_WHEEL")"

# DeepSpeed's own requirements, read from the wheel, minus what the machine has (torch, numpy).
mapfile -t DS_REQS < <("$PYTHON" - "$DS_WHEEL" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            name = re.match(r"[A-Za-z0-9._-]+", line.split(":", 1)[1].strip()).group(0)
            if name.lower() not in ("torch", "numpy"):
                print(name)
EOF
)
echo "DeepSpeed requires (downloaded): ${DS_REQS[*]}"

for PY in "${PY_VERSIONS[@]}"; do
    ABI="cp${PY/./}"
    echo "== Python $PY ($ABI)"
    TARGET=(--only-binary=:all: --dest "$STAGE"
            --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
            --platform manylinux_2_28_x86_64
            --python-version "$PY" --implementation cp --abi "$ABI" --abi abi3 --abi none)
    # pydantic-core etc. resolve per Python version; torch/numpy never (not in the lists,
    # and no package below requires them).
    "$PYTHON" -m pip download "${TARGET[@]}" "${BASE_PKGS[@]}" "${DS_REQS[@]}"
    "$PYTHON" -m pip download "${TARGET[@]}" --no-deps torchao
done

echo "== libaio (DeepSpeed async_io, offline)"
fetch_libaio() {
    local dir="$1" debs="$1/debs" lists="$BUILD/apt-lists"
    command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || {
        echo "warning: no apt-get/dpkg-deb here: libaio not carried (ZeRO-Infinity will be n/a)" >&2; return 0; }
    mkdir -p "$debs" "$lists/partial"
    local apt=(apt-get -oAPT::Architecture=amd64 -oAPT::Architectures=amd64)
    get() {  # libaio1 was renamed libaio1t64 (Debian trixie, Ubuntu 24.04)
        (cd "$debs" && "${apt[@]}" "$@" download libaio-dev \
            && { "${apt[@]}" "$@" download libaio1 || "${apt[@]}" "$@" download libaio1t64; })
    }
    # the machine's own package lists first, else fresh ones in a private folder (no root needed)
    get || { "${apt[@]}" -oDir::State::Lists="$lists" update >/dev/null && get -oDir::State::Lists="$lists"; } || {
        echo "warning: apt-get could not download libaio: not carried (ZeRO-Infinity will be n/a)" >&2
        rm -rf "$dir"; return 0; }
    local root="$BUILD/libaio-root"
    for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$root"; done
    mkdir -p "$dir/include" "$dir/lib"
    cp "$root"/usr/include/libaio.h "$dir/include/"
    cp -P "$root"/usr/lib/x86_64-linux-gnu/libaio.so* "$dir/lib/"
    # the check DeepSpeed's AsyncIOBuilder.is_compatible() makes: compile and link io_submit
    if command -v cc >/dev/null; then
        printf '#include <libaio.h>\nint main(void) { return io_submit(0, 0, 0) > 0; }\n' >"$BUILD/aio.c"
        cc "$BUILD/aio.c" -I"$dir/include" -L"$dir/lib" -laio -o "$BUILD/aio" \
            && LD_LIBRARY_PATH="$dir/lib" "$BUILD/aio"; true   # io_submit(0, ...) fails: linking is the check
        [[ -x "$BUILD/aio" ]] || { echo "error: the carried libaio does not link" >&2; return 1; }
        echo "libaio: $(ls "$dir/lib" | tr '\n' ' ')links"
    fi
}
fetch_libaio "$STAGE/libaio"

rm -rf "$BUILD"
if ls "$STAGE" | grep -qiE '^(torch|numpy|nvidia_(cu|nccl|cus))[-_0-9]' ; then
    echo "error: a torch/numpy/CUDA wheel was pulled in:" >&2; ls "$STAGE" >&2; exit 1
fi
rm -rf "$DEST"
mv "$STAGE" "$DEST"
trap - EXIT

echo "== $DEST"
ls -1 "$DEST"
SIZE_KIB="$(du -sk "$DEST" | cut -f1)"
echo "total: $((SIZE_KIB / 1024)) MiB ($(ls "$DEST"/*.whl | wc -l) wheels$([[ -d "$DEST/libaio" ]] && echo ", libaio"))"
if (( SIZE_KIB > LIMIT_MIB * 1024 )); then
    echo "error: $DEST exceeds $LIMIT_MIB MiB" >&2
    exit 1
fi
