#!/usr/bin/env bash
# The main job: install what is missing, build nestplane, and run `nestplane up`
# (a local management plane, the operator, and a tenant control plane).
# `make up ARGS="--runtime kubernetes"`: the tenant as pods on a real node, the operator
# in-cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bin_line=$(scripts/install-deps.sh | grep '^NESTPLANE_BIN_DIR=')
export "${bin_line?}"
echo "up: building nestplane (release; about 7 minutes the first time, seconds after)" >&2
cargo build --release -p nestplane-cli
exec target/release/nestplane up "$@"
