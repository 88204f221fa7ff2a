#!/usr/bin/env bash
# The test command (README and CI run exactly this): installs what is missing, then runs
# formatting, lint and dependency checks and every test against real etcd / kube-apiserver /
# kube-controller-manager processes on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each phase says when it starts, in seconds since the test command began, so a slow run
# shows where its time went.
phase() { echo "test: [${SECONDS} s] $*"; }

bin_line=$(scripts/install-deps.sh | grep '^NESTPLANE_BIN_DIR=')
export "${bin_line?}"
phase "Kubernetes binaries from $NESTPLANE_BIN_DIR"

# Compiled dependencies are kept with the Kubernetes binaries, so a fresh clone compiles only
# this workspace's own crates (cargo's build-dir holds intermediate artifacts; the binaries the
# tests run stay under this clone's target/). A build-dir given by the caller wins.
export CARGO_BUILD_BUILD_DIR="${CARGO_BUILD_BUILD_DIR:-${NESTPLANE_CACHE_DIR:-$HOME/.cache/nestplane}/cargo-build}"
phase "compiled dependencies cached in $CARGO_BUILD_BUILD_DIR"

phase "cargo fmt --check"
cargo fmt --all -- --check
phase "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
phase "cargo deny (advisories, bans, licenses, sources)"
scripts/deny.sh

if cargo nextest --version >/dev/null 2>&1; then
  # Doc tests first (nextest does not run them), so the last summary line is the real count.
  phase "doc tests"
  cargo test --workspace --doc --quiet
  phase "building the tests"
  cargo nextest run --workspace --no-run
  # .config/nextest.toml: how many run at once, and the slowest first.
  phase "running the tests"
  cargo nextest run --workspace --no-fail-fast "$@"
  phase "done"
else
  cargo test --workspace --no-fail-fast "$@"
fi
