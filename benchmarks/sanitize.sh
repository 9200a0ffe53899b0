#!/usr/bin/env bash
# Run the native tests against AddressSanitizer + UndefinedBehaviorSanitizer builds of the
# native libraries (issue 16 item 3). Not part of CI: it takes minutes.
#
#   benchmarks/sanitize.sh [extra pytest arguments]
#
# The libraries are built into a temporary copy of the package and tests, so the in-place
# build of the checkout is never replaced. Python itself is not instrumented: libasan is
# preloaded so that it can intercept the allocator before anything else loads. Leak
# detection is off (the interpreter leaks by design); any ASan report or UBSan runtime error
# aborts the run. Prints the pytest summary and exits with its status.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/zt-sanitize.XXXXXX")
trap 'rm -rf "$work"' EXIT
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
libasan=$(gcc -print-file-name=libasan.so)
[[ -e $libasan ]] || { echo "libasan not found (gcc -print-file-name=libasan.so: $libasan)" >&2; exit 2; }

cp -r "$root/zerotier" "$root/tests" "$root/native" "$root/setup.py" "$root/pyproject.toml" \
      "$root/README.md" "$work/"
rm -f "$work"/zerotier/_zt_*.so
echo "building sanitized native libraries in $work"
(cd "$work" && CFLAGS="$flags" LDFLAGS="$flags" python setup.py -q build_ext --inplace \
     --build-temp "$work/build" >"$work/build.log" 2>&1) || { cat "$work/build.log" >&2; exit 2; }

cd "$work"
export LD_PRELOAD=$libasan
export ASAN_OPTIONS=detect_leaks=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export ZT_SANITIZE_FLAGS=$flags  # tests/test_native_hardening.py builds its C++ check with them too
# The copy must be what runs, sanitized, and loaded (no silent pure-Python run).
python - <<'PY'
import pathlib, subprocess, zerotier._native as n
assert pathlib.Path(n.__file__).is_relative_to(pathlib.Path.cwd()), n.__file__
status = n.status()
assert all(v == "loaded" for v in status.values()), status
for name in ("_zt_cpu", "_zt_io"):
    deps = subprocess.run(["ldd", str(n._find(name))], capture_output=True, text=True).stdout
    assert "libasan" in deps and "libubsan" in deps, f"{name} is not sanitized:\n{deps}"
print("sanitized libraries loaded:", status)
PY
set +e
python -m pytest -q -p no:cacheprovider tests/test_cpu_adam.py tests/test_io_engine.py \
    tests/test_native_hardening.py "$@" 2>&1 | tee "$work/pytest.log"
status=${PIPESTATUS[0]}
set -e
if grep -qE "ERROR: AddressSanitizer|runtime error:" "$work/pytest.log"; then
    echo "sanitizer reports above" >&2
    status=1
fi
exit "$status"
