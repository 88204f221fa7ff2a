#!/usr/bin/env bash
# The main job: install what is missing, build nestplane, and run `nestplane up`
# (a local management plane, the operator, and a tenant control plane).
set -euo pipefail
cd "$(dirname "$0")/.."
bin_line=$(scripts/install-deps.sh | grep '^NESTPLANE_BIN_DIR=')
export "${bin_line?}"
cargo build --release --quiet -p nestplane-cli
exec target/release/nestplane up "$@"
