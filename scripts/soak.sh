#!/usr/bin/env bash
# Soak: `make soak` (see crates/cli/examples/soak.rs). Arguments: [TENANTS] [KILLS].
set -euo pipefail
cd "$(dirname "$0")/.."
bin_line=$(scripts/install-deps.sh | grep '^NESTPLANE_BIN_DIR=')
export "${bin_line?}"
echo "soak: building (release)"
cargo build --release -p nestplane-cli --bin nestplane --example soak
exec target/release/examples/soak "$@"
