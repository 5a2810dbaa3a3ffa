#!/usr/bin/env bash
# Runs every test: the C++ runtime tests (ctest) and the Python tests (pytest).
# Expects scripts/install.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
# The C++ runtime tests under AddressSanitizer + UndefinedBehaviorSanitizer (every test, leaks
# included; built -O1, as the sanitizers' documentation advises: the same checks in less
# compile time), then under ThreadSanitizer (the tests that run
# threads); any report fails. tests/cpp/tsan.supp says what is suppressed and why. (A plain build
# of the same tests would run the same code at the same optimization, without the checks: the
# release build of the runtime is what pytest exercises.)
# Only the tests each sanitizer runs are built (not the benchmark on the same harness).
all_tests=$(cd tests/cpp && ls test_*.cc | sed 's/\.cc$//')
not_threaded='^test_(reduce|strategy|peer_id)$'
sanitized() {  # $1: address or thread; then the targets
  local kind=$1
  shift
  cmake -S . -B "build/sanitize-$kind" -DKUNGFU_BUILD_TESTS=ON -DKUNGFU_BUILD_PYTHON=OFF \
    -DKUNGFU_SANITIZE="$kind" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g -DNDEBUG" > "build-sanitize-$kind.log"
  cmake --build "build/sanitize-$kind" -j "$jobs" --target "$@" >> "build-sanitize-$kind.log" \
    || { cat "build-sanitize-$kind.log"; exit 1; }
  rm -f "build-sanitize-$kind.log"
}
# shellcheck disable=SC2086  # one target per word
sanitized address $all_tests
(cd build/sanitize-address \
  && ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:allocator_may_return_null=1 \
     UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ctest --output-on-failure -j "$jobs")
# shellcheck disable=SC2046
sanitized thread $(echo "$all_tests" | grep -v -E "$not_threaded")
# test_algorithms computes more than it waits: alone, since beside another test it can pass its
# own per-case limit under ThreadSanitizer; the others wait more than they compute, two at a time.
(cd build/sanitize-thread \
  && export TSAN_OPTIONS="halt_on_error=1:history_size=7:allocator_may_return_null=1:suppressions=$PWD/../../tests/cpp/tsan.supp" \
  && ctest --output-on-failure -R '^test_algorithms$' \
  && ctest --output-on-failure -j "$jobs" -E "$not_threaded|^test_algorithms\$")
# libFuzzer on the frame and handshake parsers for a bounded time (needs clang; see
# tests/cpp/fuzz_frames.cc). A finding fails CI and leaves its input in build/fuzz/.
if command -v clang++ >/dev/null 2>&1; then
  CC=clang CXX=clang++ cmake -S . -B build/fuzz -DKUNGFU_BUILD_PYTHON=OFF -DKUNGFU_SANITIZE=address \
    -DKUNGFU_LIBFUZZER=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo > build-fuzz.log
  cmake --build build/fuzz -j "$jobs" --target fuzz_frames >> build-fuzz.log \
    || { cat build-fuzz.log; exit 1; }
  rm -f build-fuzz.log
  (cd build/fuzz && ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
     ./fuzz_frames -max_total_time=30 -seed=1 -timeout=10 -rss_limit_mb=4096 2>&1 | tail -n 30)
else
  echo "clang++ not found: the libFuzzer run of the parsers is skipped (scripts/install.sh installs clang where it can)"
fi
echo "test.sh: the C++ runtime's sanitizer and fuzz runs took ${SECONDS}s"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 tests "$@"
