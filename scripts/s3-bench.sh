#!/usr/bin/env bash
# S3 save/load benchmark (examples/s3_bench.rs) against s3s-fs on loopback, each figure beside
# a raw object_store baseline measured in the same run against the same server:
#   save vs a raw multipart PUT of the same bytes; open (and open + verify) vs raw parallel
#   ranged GETs of the same bytes.
# Usage: bash scripts/s3-bench.sh [SIZE_MIB=1024] [REPS=3]
# To run against another server (a Garage cluster, say), set AWS_ENDPOINT_URL and the
# credentials yourself and call: cargo run --release --example s3_bench -- s3://BUCKET/PREFIX MIB REPS
set -euo pipefail
cd "$(dirname "$0")/.."
MIB="${1:-1024}"
REPS="${2:-3}"
S3S="${CKPT_S3S_FS:-$(command -v s3s-fs || echo "$HOME/.cargo/bin/s3s-fs")}"
[ -x "$S3S" ] || { echo "s3s-fs not found: cargo install s3s-fs@0.14.1 --locked --features binary" >&2; exit 1; }
cargo build --release --example s3_bench >/dev/null
W="$(mktemp -d)"
mkdir "$W/bench"
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
"$S3S" --host 127.0.0.1 --port "$PORT" --access-key benchkey --secret-key benchsecret0123 "$W" >/dev/null 2>&1 &
SRV=$!
trap 'kill -9 $SRV 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$W"' EXIT
deadline=$((SECONDS + 30))
until python3 -c "import socket; socket.create_connection(('127.0.0.1', $PORT), 1).close()" 2>/dev/null; do
  [ $SECONDS -lt $deadline ] || { echo "s3s-fs did not start" >&2; exit 1; }
  sleep 0.1
done
AWS_ENDPOINT_URL="http://127.0.0.1:$PORT" AWS_ACCESS_KEY_ID=benchkey AWS_SECRET_ACCESS_KEY=benchsecret0123 \
AWS_REGION=us-east-1 AWS_ALLOW_HTTP=true \
  target/release/examples/s3_bench "s3://bench/run" "$MIB" "$REPS"
