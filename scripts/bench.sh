#!/usr/bin/env bash
# Benchmarks.
#  1. `nestplane up` from start to a ready tenant (process runtime), on a fresh state
#     directory, N runs (default 3): every figure `nestplane up --exit-when-ready` reports.
#  3. A HostedCluster applied to Available with N real nodes Ready (N = 1, 3):
#     `nestplane up --nodes N --exit-when-ready`; `tenant_seconds` is that time.
#  2. Real nodes: node start to Ready (and its timeline), memory of an idle node, and a `NestedControlPlane` to
#     Ready in the kubernetes runtime on a real node (crates/cli/examples/nodes_bench.rs).
#  4. The built-in DNS server with 2,000 Services: queries/s and p99 latency from dnsperf,
#     resident memory (crates/cli/examples/dns_bench.rs).
#  5. Memory per tenant with N = 1, 10, 30 tenants (process runtime), each with an etcd of its
#     own and then all on one shared NestedDatastore; the operator's memory
#     (crates/cli/examples/tenants_bench.rs).
#  6. Start-up overhead: the same four components started by hand (etcd -> API server ->
#     controller-manager + scheduler, same binaries, flags and certificates) against a tenant
#     through nestplane, alternately in one run; bare_seconds, nestplane_seconds and their ratio
#     (crates/cli/examples/startup_bench.rs; runs: BENCH_STARTUP_RUNS, default 11).
#  7. One operator, many control planes: 1,000 NestedControlPlanes in the kubernetes runtime
#     against a local management plane without nodes; time until every one has its objects,
#     the operator's peak memory, and the writes of 60 s of steady state afterwards
#     (crates/cli/examples/scale_bench.rs; BENCH_SCALE_TENANTS, default 1000).
#  8. The cost of measuring 100 tenants' usage on a shared datastore for their quotas: one
#     pass's time and etcd's CPU (crates/cli/examples/quota_bench.rs).
#  9. A management plane (as each test starts one) to nestplane's CRDs served, installed on a
#     running API server or stored before it starts: seconds and the API server's CPU
#     (crates/cli/examples/plane_bench.rs; BENCH_PLANE_RUNS, default 5).
# 10. Backup and restore throughput of one tenant's 10,000 keys (about 1.5 KiB each) on a scratch
#     etcd: export at one revision, seal, open, restore under a new prefix; keys/s and MiB/s
#     (crates/cli/examples/backup_bench.rs; BACKUP_BENCH_KEYS, BACKUP_BENCH_RUNS).
set -euo pipefail
cd "$(dirname "$0")/.."
bin_line=$(scripts/install-deps.sh | grep '^NESTPLANE_BIN_DIR=')
export "${bin_line?}"
echo "bench: building nestplane (release)" >&2
cargo build --release -p nestplane-cli --bin nestplane --example nodes_bench --example dns_bench \
  --example startup_bench --example scale_bench --example tenants_bench --example quota_bench \
  --example plane_bench --example backup_bench
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
echo "start-up overhead (by hand against nestplane, alternately)"
target/release/examples/startup_bench "${BENCH_STARTUP_RUNS:-11}" | sed 's/^/  /'
echo "one operator, many control planes"
target/release/examples/scale_bench "${BENCH_SCALE_TENANTS:-1000}" 60 | sed 's/^/  /'
echo "measuring tenants on a shared datastore (quotas)"
target/release/examples/quota_bench | sed 's/^/  /'
echo "a management plane to nestplane's CRDs served (installed on a running API server, or stored first)"
target/release/examples/plane_bench "${BENCH_PLANE_RUNS:-5}" | sed 's/^/  /'
echo "backup and restore throughput (one tenant's keys, scratch etcd)"
target/release/examples/backup_bench | sed 's/^/  /'
