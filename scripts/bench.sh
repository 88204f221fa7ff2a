#!/usr/bin/env bash
# Benchmarks.
#  1. `nestplane up` from start to a ready tenant (process runtime), on a fresh state
#     directory, N runs (default 3): every figure `nestplane up --exit-when-ready` reports.
#  3. A HostedCluster applied to Available with N real nodes Ready (N = 1, 3):
#     `nestplane up --nodes N --exit-when-ready`; `tenant_seconds` is that time.
#  2. Real nodes: node start to Ready, memory of an idle node, and a `NestedControlPlane` to
#     Ready in the kubernetes runtime on a real node (crates/cli/examples/nodes_bench.rs).
#  4. The built-in DNS server with 2,000 Services: queries/s and p99 latency from dnsperf,
#     resident memory (crates/cli/examples/dns_bench.rs).
#  5. Memory per tenant with N = 1, 10, 30 tenants (process runtime), each with an etcd of its
#     own and then all on one shared NestedDatastore; the operator's memory
#     (crates/cli/examples/tenants_bench.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
bin_line=$(scripts/install-deps.sh | grep '^NESTPLANE_BIN_DIR=')
export "${bin_line?}"
echo "bench: building nestplane (release)" >&2
cargo build --release -p nestplane-cli --bin nestplane --example nodes_bench --example dns_bench --example tenants_bench
runs="${1:-3}"
for i in $(seq 1 "$runs"); do
  dir=$(mktemp -d)
  echo "up run $i (state in $dir)"
  target/release/nestplane up --exit-when-ready --state-dir "$dir" 2>/dev/null | grep -v '^kubectl' | sed 's/^/  /'
  rm -rf "$dir"
done
echo "nodes (images built here first)"
target/release/nestplane images build >/dev/null
target/release/examples/nodes_bench | sed 's/^/  /'
for n in 1 3; do
  dir=$(mktemp -d)
  echo "hosted cluster with $n node(s) (state in $dir); tenant_seconds = HostedCluster applied -> Available and $n node(s) Ready"
  target/release/nestplane up --nodes "$n" --exit-when-ready --state-dir "$dir" 2>/dev/null | grep -v '^kubectl' | sed 's/^/  /'
  rm -rf "$dir"
done
echo "cluster DNS (built-in server, dnsperf)"
target/release/examples/dns_bench | sed 's/^/  /'
echo "memory per tenant (process runtime; own etcd, then one shared datastore)"
target/release/examples/tenants_bench | sed 's/^/  /'
