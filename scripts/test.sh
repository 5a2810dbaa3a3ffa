#!/usr/bin/env bash
# Runs every test: the C++ runtime tests (ctest) and the Python tests (pytest).
# Expects scripts/install.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
# The C++ runtime tests under AddressSanitizer + UndefinedBehaviorSanitizer (every test, leaks
# included), then under ThreadSanitizer (the tests that run threads); any report fails.
# tests/cpp/tsan.supp says what is suppressed and why. (A plain build of the same tests would run
# the same code without the checks: the release build of the runtime is what pytest exercises.)
# Only the tests each sanitizer runs are built (not the benchmark on the same harness).
# How the builds are kept short (measured on the 2-core machine, ASan + UBSan build):
# - -O1, as the sanitizers' documentation advises (the checks are the same; -O2/-O3 took about
#   60% more compile time);
# - one unity source per target (CMAKE_UNITY_BUILD: the runtime's files share one parse of the
#   headers; about 25% less);
# - Ninja where it is installed: make builds the targets named on one command line one after the
#   other (CMake's top Makefile is .NOTPARALLEL), so every test compiled on one core;
# - the three builds (ASan + UBSan, TSan, libFuzzer) run beside pytest, at the lowest priority,
#   on the time its workers leave idle (below); the sanitizer tests run after it.
# (-O1 runs the tests as fast as -O2: ctest took 43 s under ASan and 148 s under TSan at -O2, 45 s
# and 152 s at -O1.)
all_tests=$(cd tests/cpp && ls test_*.cc | sed 's/\.cc$//')
not_threaded='^test_(reduce|strategy|peer_id)$'
generator=()
if command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
fi
fast_build=("${generator[@]}" -DCMAKE_UNITY_BUILD=ON)
# $1: the build folder, then cmake's arguments. A folder configured by another generator (an
# earlier build) is made afresh: cmake refuses to switch.
configure() {
  local dir=$1 wanted=${generator[1]:-Unix Makefiles}
  shift
  if [ -f "$dir/CMakeCache.txt" ] \
      && ! grep -qx "CMAKE_GENERATOR:INTERNAL=$wanted" "$dir/CMakeCache.txt"; then
    rm -rf "$dir"
  fi
  cmake -S . -B "$dir" "${fast_build[@]}" "$@"
}
sanitized() {  # $1: address or thread; then the targets
  local kind=$1
  shift
  configure "build/sanitize-$kind" -DKUNGFU_BUILD_TESTS=ON \
    -DKUNGFU_BUILD_PYTHON=OFF -DKUNGFU_SANITIZE="$kind" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g -DNDEBUG" > "build-sanitize-$kind.log"
  cmake --build "build/sanitize-$kind" -j "$jobs" --target "$@" >> "build-sanitize-$kind.log" \
    || { cat "build-sanitize-$kind.log"; exit 1; }
  rm -f "build-sanitize-$kind.log"
}
took() {  # where the time goes: $1 what, since $2 (a SECONDS value)
  echo "test.sh: $1 took $((SECONDS - $2))s"
}
# pytest waits more than it computes (its workers sleep through start-ups, deadlines and
# recoveries): the sanitizer builds run beside it at the lowest priority (nice 19), on the time
# it leaves idle, so that they do not slow it; the sanitizer tests, which have deadlines of their
# own, run after it on an idle machine. A build that fails fails the run once pytest is done; on
# any exit the script waits for what it started.
trap 'wait' EXIT
builds() {
  local t=$SECONDS
  # shellcheck disable=SC2086  # one target per word
  sanitized address $all_tests
  took "the ASan + UBSan build (beside pytest)" "$t"
  t=$SECONDS
  # shellcheck disable=SC2046
  sanitized thread $(echo "$all_tests" | grep -v -E "$not_threaded")
  took "the TSan build (beside pytest)" "$t"
  if command -v clang++ >/dev/null 2>&1; then
    t=$SECONDS
    fuzz_build
    took "the libFuzzer build (beside pytest)" "$t"
  fi
}
fuzz_build() {
  CC=clang CXX=clang++ configure build/fuzz -DKUNGFU_BUILD_PYTHON=OFF \
    -DKUNGFU_SANITIZE=address -DKUNGFU_LIBFUZZER=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo > build-fuzz.log
  cmake --build build/fuzz -j "$jobs" --target fuzz_frames >> build-fuzz.log \
    || { cat build-fuzz.log; exit 1; }
  rm -f build-fuzz.log
}
(renice -n 19 -p "$BASHPID" > /dev/null && builds) &
builds_pid=$!
t=$SECONDS
status=0
# Two pytest processes, each taking whole files (module fixtures stay shared in a file; the
# tests start their own worker processes on free ports, and the fault tests' timings leave room
# for a busy machine). Many files wait on their workers more than they compute (alone on the
# 2-core machine, test_recovery_numpy.py took 113 s and 42 CPU-seconds; test_keras_habits_2.py,
# 76 s and 129), and two at a time took 1109 s where one took 1570 s, with the same builds
# beside it.
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 -n 2 --dist loadfile tests "$@" \
  || status=$?
took "pytest" "$t"
t=$SECONDS
wait "$builds_pid" || { echo "test.sh: a sanitizer build failed (above)"; exit 1; }
took "waiting for the sanitizer builds after pytest" "$t"
t=$SECONDS
(cd build/sanitize-address \
  && ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:allocator_may_return_null=1 \
     UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ctest --output-on-failure -j "$jobs")
took "ctest under ASan + UBSan" "$t"
# test_algorithms computes more than it waits: alone, since beside another test it can pass its
# own per-case limit under ThreadSanitizer; the others wait more than they compute, two at a time.
t=$SECONDS
(cd build/sanitize-thread \
  && export TSAN_OPTIONS="halt_on_error=1:history_size=7:allocator_may_return_null=1:suppressions=$PWD/../../tests/cpp/tsan.supp" \
  && ctest --output-on-failure -R '^test_algorithms$' \
  && ctest --output-on-failure -j "$jobs" -E "$not_threaded|^test_algorithms\$")
took "ctest under TSan" "$t"
# libFuzzer on the frame and handshake parsers for a bounded time (needs clang; see
# tests/cpp/fuzz_frames.cc). A finding fails CI and leaves its input in build/fuzz/.
if [ -x build/fuzz/fuzz_frames ]; then
  (cd build/fuzz && ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
     ./fuzz_frames -max_total_time=30 -seed=1 -timeout=10 -rss_limit_mb=4096 2>&1 | tail -n 30)
else
  echo "clang++ not found: the libFuzzer run of the parsers is skipped (scripts/install.sh installs clang where it can)"
fi
trap - EXIT
echo "test.sh: everything took ${SECONDS}s"
exit "$status"
