#!/usr/bin/env bash
# The test command (README and CI run exactly this): installs what is missing, then runs
# formatting, lint and dependency checks and every test against real etcd / kube-apiserver /
# kube-controller-manager processes on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."

bin_line=$(scripts/install-deps.sh | grep '^NESTPLANE_BIN_DIR=')
export "${bin_line?}"
echo "test: Kubernetes binaries from $NESTPLANE_BIN_DIR"

echo "test: cargo fmt --check"
cargo fmt --all -- --check
echo "test: cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "test: cargo deny (advisories, bans, licenses, sources)"
scripts/deny.sh

if cargo nextest --version >/dev/null 2>&1; then
  # Doc tests first (nextest does not run them), so the last summary line is the real count.
  cargo test --workspace --doc --quiet
  cargo nextest run --workspace --no-fail-fast "$@"
else
  cargo test --workspace --no-fail-fast "$@"
fi
