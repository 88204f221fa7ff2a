#!/usr/bin/env bash
# Benchmark: `nestplane up` from start to a ready tenant, on a fresh state directory, N runs
# (default 3). Prints every figure `nestplane up --exit-when-ready` reports, per run.
set -euo pipefail
cd "$(dirname "$0")/.."
bin_line=$(scripts/install-deps.sh | grep '^NESTPLANE_BIN_DIR=')
export "${bin_line?}"
cargo build --release --quiet -p nestplane-cli
runs="${1:-3}"
for i in $(seq 1 "$runs"); do
  dir=$(mktemp -d)
  echo "run $i (state in $dir)"
  target/release/nestplane up --exit-when-ready --state-dir "$dir" 2>/dev/null | grep -v '^kubectl' | sed 's/^/  /'
  rm -rf "$dir"
done
