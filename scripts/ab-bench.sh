#!/usr/bin/env bash
# Alternated A/B performance run: a previous build ("old") against a new one ("new"), in the
# same sitting, each benchmark run on both back to back, the order swapped every round
# (round 1 old,new; round 2 new,old; ...), so that drift on a shared machine touches both:
#   (a) ckpt bench --size 512MiB --tensors 64 --json          (hot page cache)
#   (b) ckpt bench --size 512MiB --tensors 64 --cold --json   (shard files evicted)
#   (c) examples/s3_bench against a freshly started s3s-fs on a free loopback port (256 MiB)
#   (d) python/benches/bench_torch.py --restore (3 x Linear(4096, 4096) + Adam, ways raw,ckptstore)
# Every figure these print is beside a baseline measured in the same run; the summary gives,
# per metric, the median over rounds for old and new and new/old (ratios against each run's
# own baseline are the figures to read: raw seconds move with the machine's load).
#
# Usage: bash scripts/ab-bench.sh OLD_DIR NEW_DIR OUT_DIR [ROUNDS=3]
#   OLD_DIR, NEW_DIR: source trees with target/release/ckpt and target/release/examples/s3_bench
#     built (cargo build --release --bin ckpt --example s3_bench).
#   OLD_PY, NEW_PY (env): PYTHONPATH directories holding each build's `ckptstore` package (an
#     unpacked wheel); NEW_PY empty: the package the interpreter imports by itself (the venv's).
#   PYTHON (env): the interpreter (default NEW_DIR/.venv/bin/python).
#   TORCH_SCRIPT=new|own (env, default new): run NEW_DIR's python/benches/bench_torch.py for both
#     packages (the same measuring code; only the package differs), or each tree's own.
#   Sizes (env): CKPT_SIZE=512MiB CKPT_TENSORS=64 S3_MIB=256 S3_REPS=3 TORCH_LAYERS=3
#     TORCH_WIDTH=4096 TORCH_REPEAT=2 TORCH_WAYS=raw,ckptstore.
# The binaries, the packages and the bench scripts are copied into a scratch directory at the
# start, so that a rebuild of either tree during the run changes nothing measured. Scratch
# (checkpoints, the s3s-fs root) lives under OUT_DIR/.scratch (TMPDIR points there) and is
# removed at the end, with the s3s-fs server; at most ~2.5 GiB on disk at a time.
# Outputs: OUT_DIR/<round>-<old|new>-<bench>.{json,txt}, runs.tsv (seconds per run),
# env.txt (what was compared), summary.txt. `bash scripts/ab-bench.sh --summary OUT_DIR` prints the
# summary again from the outputs there.
set -euo pipefail
# ---- summary ---------------------------------------------------------------------------------
summary() {
"${PYTHON:-python3}" - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import glob, json, os, re, statistics, sys

out = sys.argv[1]
runs = {}  # (bench, which) -> [dict]

def flat_torch(text):
    line = [l for l in text.splitlines() if l.startswith("JSON ")][-1]
    j = json.loads(line[5:])
    d = {}
    for cache in ("cold", "hot"):
        ck, raw = j.get(f"{cache}_ckptstore"), j.get(f"{cache}_raw")
        if ck:
            d[f"{cache}_ckptstore_load_s"] = ck["load_s"]
            d[f"{cache}_ckptstore_first_step_s"] = ck["first_step_s"]
            d[f"{cache}_ckptstore_peak_rss_over_before_mib"] = (ck["peak_after_load_kib"] - ck["rss_before_kib"]) / 1024
        if raw:
            d[f"{cache}_raw_load_s"] = raw["load_s"]
        if ck and raw:
            d[f"{cache}_raw_over_ckptstore_ratio"] = raw["load_s"] / ck["load_s"]
    return d

for f in sorted(glob.glob(os.path.join(out, "*-*-*.json")) + glob.glob(os.path.join(out, "*-*-torch.txt"))):
    m = re.match(r"(\d+)-(old|new)-(\w+)\.(json|txt)$", os.path.basename(f))
    if not m:
        continue
    text = open(f).read()
    try:
        d = flat_torch(text) if m[3] == "torch" else json.loads(text.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001
        print(f"skipping {f}: {e}")
        continue
    runs.setdefault((m[3], m[2]), []).append(d)

# (bench, key, higher is better)
METRICS = {
    "hot": [("save_ratio", 1), ("verify_ratio", 1), ("load_f16_scaled_ratio", 1), ("load_bf16_ratio", 1),
            ("load_f32_ratio", 1), ("load_f16_scaled_fresh_ratio", 1), ("load_bf16_fresh_ratio", 1),
            ("load_f32_fresh_ratio", 1), ("save_gibps", 1), ("verify_gibps", 1), ("load_f32_gibps", 1),
            ("load_f32_fresh_gibps", 1), ("memcpy_fresh_gibps", 1), ("open_ms", 0)],
    "cold": [("load_f16_scaled_cold_ratio", 1), ("load_bf16_cold_ratio", 1), ("load_f32_cold_ratio", 1),
             ("load_f16_scaled_cold_pooled_ratio", 1), ("load_bf16_cold_pooled_ratio", 1),
             ("load_f32_cold_pooled_ratio", 1), ("load_f32_cold_gibps", 1), ("raw_read_cold_gibps", 1)],
    "s3": [("save_ratio", 1), ("open_ratio", 1), ("open_verify_ratio", 1), ("open_verify_vs_raw_fresh_ratio", 1),
           ("save_gibps", 1), ("open_verify_gibps", 1), ("raw_ranged_get_gibps", 1)],
    "torch": [("cold_raw_over_ckptstore_ratio", 1), ("hot_raw_over_ckptstore_ratio", 1),
              ("cold_ckptstore_load_s", 0), ("hot_ckptstore_load_s", 0),
              ("cold_ckptstore_first_step_s", 0), ("hot_ckptstore_first_step_s", 0),
              ("cold_raw_load_s", 0), ("hot_raw_load_s", 0), ("hot_ckptstore_peak_rss_over_before_mib", 0)],
}

def med(rs, k):
    """(median, n, spread): spread = (max - min) / median over the rounds, the noise to weigh
    new/old against."""
    v = [r[k] for r in rs if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
    if not v:
        return None, 0, float("nan")
    m = statistics.median(v)
    return m, len(v), ((max(v) - min(v)) / m if m else float("nan"))

print("median over rounds of old and new; new/old; spread = (max - min) / median over the rounds;\n"
      "hi/lo: which way is better; '<-' marks new worse by more than 5% and more than the spread")
print(f"{'bench':<6} {'metric':<40} {'old':>9} {'new':>9} {'new/old':>8} {'spread o/n':>11}  n")
for bench, keys in METRICS.items():
    o, n = runs.get((bench, "old"), []), runs.get((bench, "new"), [])
    for k, hi in keys:
        mo, no, so = med(o, k)
        mn, nn, sn = med(n, k)
        if mo is None and mn is None:
            continue
        rel = mn / mo if mo and mn is not None else float("nan")
        noise = max(so, sn) if min(no, nn) > 1 else 0.0
        worse = (rel < 1 - max(0.05, noise)) if hi else (rel > 1 + max(0.05, noise))
        fmt = lambda x: f"{x:9.3f}" if x is not None else f"{'-':>9}"
        spread = f"{so:5.0%}/{sn:<5.0%}" if min(no, nn) > 1 else f"{'-':>11}"
        print(f"{bench:<6} {k:<40} {fmt(mo)} {fmt(mn)} {rel:8.3f} {spread:>11}  {min(no, nn)} {'hi' if hi else 'lo'}"
              f"{'  <-' if worse else ''}")
    for which, rs in (("old", o), ("new", n)):
        for r in rs:
            if r.get("crc_fused") is False or r.get("simd_f16") is False:
                print(f"{bench:<6} note: a {which} run reports crc_fused/simd_f16 false")
EOF
}

if [ "${1:-}" = --summary ]; then OUT="${2:?--summary OUT_DIR}"; summary; exit; fi
[ $# -ge 3 ] || { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2; }
OLD_DIR="$(cd "$1" && pwd)"
NEW_DIR="$(cd "$2" && pwd)"
mkdir -p "$3"
OUT="$(cd "$3" && pwd)"
ROUNDS="${4:-3}"
PYTHON="${PYTHON:-$NEW_DIR/.venv/bin/python}"
TORCH_SCRIPT="${TORCH_SCRIPT:-new}"
CKPT_SIZE="${CKPT_SIZE:-512MiB}"
CKPT_TENSORS="${CKPT_TENSORS:-64}"
S3_MIB="${S3_MIB:-256}"
S3_REPS="${S3_REPS:-3}"
TORCH_LAYERS="${TORCH_LAYERS:-3}"
TORCH_WIDTH="${TORCH_WIDTH:-4096}"
TORCH_REPEAT="${TORCH_REPEAT:-2}"
TORCH_WAYS="${TORCH_WAYS:-raw,ckptstore}"
S3S="${CKPT_S3S_FS:-$(command -v s3s-fs || echo "$HOME/.cargo/bin/s3s-fs")}"
[ -x "$S3S" ] || { echo "s3s-fs not found: cargo install s3s-fs@0.14.1 --locked --features binary" >&2; exit 1; }
[ -x "$PYTHON" ] || { echo "no interpreter at $PYTHON (set PYTHON)" >&2; exit 1; }
case "$TORCH_SCRIPT" in new|own) ;; *) echo "TORCH_SCRIPT is new or own" >&2; exit 2 ;; esac

W="$OUT/.scratch"
rm -rf "$W"
mkdir -p "$W/tmp"
SRV=""
cleanup() {
  if [ -n "$SRV" ]; then kill "$SRV" 2>/dev/null || true; wait "$SRV" 2>/dev/null || true; fi
  rm -rf "$W"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
export TMPDIR="$W/tmp"

# ---- pin what is compared -------------------------------------------------------------------
: >"$OUT/env.txt"
for which in old new; do
  if [ $which = old ]; then dir="$OLD_DIR"; py="${OLD_PY:-}"; else dir="$NEW_DIR"; py="${NEW_PY:-}"; fi
  mkdir -p "$W/$which/bin" "$W/$which/py" "$W/$which/script"
  for b in ckpt examples/s3_bench; do
    [ -x "$dir/target/release/$b" ] || { echo "missing $dir/target/release/$b (cargo build --release --bin ckpt --example s3_bench)" >&2; exit 1; }
    cp "$dir/target/release/$b" "$W/$which/bin/"
  done
  # The package this build's Python runs imports, copied whole (the compiled extension with it).
  pkg="$(env -u PYTHONPATH ${py:+PYTHONPATH="$py"} "$PYTHON" -c 'import ckptstore, os; print(os.path.dirname(ckptstore.__file__))')"
  if [ -n "$py" ]; then
    case "$pkg" in "$(cd "$py" && pwd)"/*) ;; *) echo "$which: PYTHONPATH=$py imports ckptstore from $pkg, not from it" >&2; exit 1 ;; esac
  fi
  cp -r "$pkg" "$W/$which/py/ckptstore"
  sdir="$NEW_DIR/python/benches"; [ "$TORCH_SCRIPT" = own ] && sdir="$dir/python/benches"
  [ -d "$sdir" ] || sdir="${sdir%/benches}"  # a tree from before the benches moved
  cp "$sdir/bench_torch.py" "$W/$which/script/"
  [ -f "$sdir/bench_util.py" ] && cp "$sdir/bench_util.py" "$W/$which/script/"
  got="$(PYTHONPATH="$W/$which/py" "$PYTHON" -c 'import ckptstore; print(ckptstore.__file__)')"
  [ "$got" = "$W/$which/py/ckptstore/__init__.py" ] || { echo "$which: the pinned package does not import first ($got)" >&2; exit 1; }
  {
    echo "$which: tree $dir at $(git -C "$dir" rev-parse --short HEAD 2>/dev/null || echo '?')" \
         "($(git -C "$dir" status --porcelain --untracked-files=no 2>/dev/null | wc -l) files changed since)"
    echo "  ckpt      $(sha256sum "$W/$which/bin/ckpt" | cut -c1-16)  built $(date -r "$dir/target/release/ckpt" '+%F %T')"
    echo "  s3_bench  $(sha256sum "$W/$which/bin/s3_bench" | cut -c1-16)  built $(date -r "$dir/target/release/examples/s3_bench" '+%F %T')"
    so="$(ls "$pkg"/_ckptstore*.so | head -1)"
    echo "  python    $pkg  ($(basename "$so") $(sha256sum "$so" | cut -c1-16), built $(date -r "$so" '+%F %T'))"
    echo "  script    $sdir/bench_torch.py"
  } >>"$OUT/env.txt"
done
{
  echo "rounds $ROUNDS; ckpt bench --size $CKPT_SIZE --tensors $CKPT_TENSORS; s3_bench $S3_MIB MiB x $S3_REPS;" \
       "bench_torch --restore --layers $TORCH_LAYERS --width $TORCH_WIDTH --repeat $TORCH_REPEAT --ways $TORCH_WAYS"
  echo "$(nproc) CPUs; load average $(cut -d' ' -f1-3 /proc/loadavg); $(date '+%F %T')"
} >>"$OUT/env.txt"
cat "$OUT/env.txt"

free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# ---- one run ---------------------------------------------------------------------------------
# run ROUND WHICH BENCH: writes OUT/ROUND-WHICH-BENCH.{json|txt}; a failed run is logged and
# left out of the summary (its stderr kept in .err).
run() {
  local round=$1 which=$2 bench=$3 bin="$W/$2/bin" ext=json
  [ "$bench" = torch ] && ext=txt
  local out="$OUT/$round-$which-$bench.$ext" t0 rc=0
  t0=$EPOCHREALTIME
  case "$bench" in
    hot)  nice -n 0 "$bin/ckpt" bench --size "$CKPT_SIZE" --tensors "$CKPT_TENSORS" --json >"$out" 2>"$out.err" || rc=$? ;;
    cold) nice -n 0 "$bin/ckpt" bench --size "$CKPT_SIZE" --tensors "$CKPT_TENSORS" --cold --json >"$out" 2>"$out.err" || rc=$? ;;
    s3)
      local root="$W/s3root" port
      rm -rf "$root"; mkdir -p "$root/bench"
      port="$(free_port)"
      "$S3S" --host 127.0.0.1 --port "$port" --access-key benchkey --secret-key benchsecret0123 "$root" >"$W/s3s.log" 2>&1 &
      SRV=$!
      local deadline=$((SECONDS + 30))
      until "$PYTHON" -c "import socket; socket.create_connection(('127.0.0.1', $port), 1).close()" 2>/dev/null; do
        [ $SECONDS -lt $deadline ] || { echo "s3s-fs did not start" >"$out.err"; rc=1; break; }
        sleep 0.1
      done
      if [ $rc = 0 ]; then
        AWS_ENDPOINT_URL="http://127.0.0.1:$port" AWS_ACCESS_KEY_ID=benchkey AWS_SECRET_ACCESS_KEY=benchsecret0123 \
        AWS_REGION=us-east-1 AWS_ALLOW_HTTP=true \
          nice -n 0 "$bin/s3_bench" "s3://bench/run" "$S3_MIB" "$S3_REPS" >"$out" 2>"$out.err" || rc=$?
      fi
      kill "$SRV" 2>/dev/null || true; wait "$SRV" 2>/dev/null || true; SRV=""
      rm -rf "$root" ;;
    torch)
      PYTHONPATH="$W/$which/py" nice -n 0 "$PYTHON" "$W/$which/script/bench_torch.py" --restore \
        --layers "$TORCH_LAYERS" --width "$TORCH_WIDTH" --repeat "$TORCH_REPEAT" --ways "$TORCH_WAYS" \
        --dir "$W/torch" >"$out" 2>"$out.err" || rc=$?
      rm -rf "$W/torch" ;;
  esac
  rm -rf "${TMPDIR:?}"/* 2>/dev/null || true
  local dt; dt=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { print b - a }')
  [ -s "$out.err" ] || rm -f "$out.err"
  printf '%s\t%s\t%s\t%.1f\t%s\n' "$round" "$which" "$bench" "$dt" "$rc" >>"$OUT/runs.tsv"
  printf '  round %s %-3s %-5s %6.1f s%s\n' "$round" "$which" "$bench" "$dt" "$([ $rc = 0 ] || echo "  FAILED rc=$rc: see $out.err")"
  if [ $rc != 0 ]; then mv "$out" "$out.failed" 2>/dev/null || true; fi
}

printf 'round\twhich\tbench\tseconds\trc\n' >"$OUT/runs.tsv"
for ((r = 1; r <= ROUNDS; r++)); do
  if ((r % 2)); then order="old new"; else order="new old"; fi
  echo "round $r/$ROUNDS ($order), load average $(cut -d' ' -f1-3 /proc/loadavg)"
  for bench in hot cold s3 torch; do
    for which in $order; do run "$r" "$which" "$bench"; done
  done
done

summary
echo "outputs: $OUT"
