#!/usr/bin/env bash
# Fuzz every target for a bounded time (CI entry point).
#
#   FUZZ_SECONDS=30 fuzz/run.sh          # seconds per target (default 30)
#   FUZZ_TARGETS="header manifest" ...   # a subset (default: all eight)
#   FUZZ_TOOLCHAIN=nightly ...           # toolchain for cargo-fuzz (default nightly)
#
# 1. installs cargo-fuzz if it is missing, 2. writes the seed corpora with gen_seeds,
# 3. runs each target with -max_total_time, printing its exec count ("Done N runs").
# Exits non-zero if any target crashes, times out, leaks or fails to build; the crashing
# input is under fuzz/artifacts/<target>/ and the full log under fuzz/artifacts/logs/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

seconds="${FUZZ_SECONDS:-30}"
toolchain="${FUZZ_TOOLCHAIN:-nightly}"
read -r -a targets <<<"${FUZZ_TARGETS:-header manifest open_verify_load structured part fetched journal two_level}"
logs="artifacts/logs"

if ! cargo "+$toolchain" fuzz --help >/dev/null 2>&1; then
    echo "run.sh: installing cargo-fuzz" >&2
    cargo install cargo-fuzz
fi

echo "run.sh: generating seeds" >&2
cargo "+$toolchain" run --quiet --bin gen_seeds

mkdir -p "$logs"
failed=()
summary=()
for t in "${targets[@]}"; do
    log="$logs/$t.log"
    echo "run.sh: fuzzing $t for ${seconds}s (log: fuzz/$log)" >&2
    # -timeout: a single input running this long counts as a failure (a hang).
    if cargo "+$toolchain" fuzz run "$t" -- \
        -max_total_time="$seconds" -timeout=25 -print_final_stats=1 >"$log" 2>&1; then
        rc=0
    else
        rc=$?
    fi
    done_line="$(grep -E '^Done [0-9]+ runs' "$log" | tail -n 1 || true)"
    if [[ $rc -ne 0 || -z $done_line ]]; then
        echo "run.sh: $t FAILED (exit $rc); last lines of fuzz/$log:" >&2
        tail -n 60 "$log" >&2
        grep -E 'Test unit written to|panicked at' "$log" >&2 || true
        failed+=("$t")
        summary+=("$t: FAILED (exit $rc)")
    else
        summary+=("$t: $done_line")
    fi
done

echo "run.sh: results (${seconds}s per target)"
for s in "${summary[@]}"; do
    echo "  $s"
done
if ((${#failed[@]})); then
    echo "run.sh: crashes or failures in: ${failed[*]}" >&2
    exit 1
fi
