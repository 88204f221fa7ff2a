#!/usr/bin/env bash
# make conformance: the upstream [Conformance] specs of the cluster's Kubernetes version
# against a fresh `nestplane up --nodes 2` hosted cluster. Not part of `make test` (it takes
# long on 2 cores).
#
#   make conformance                      # every non-[Serial] [Conformance] spec, in parallel
#   make conformance ARGS=serial          # the [Serial] ones, one at a time
#   make conformance ARGS=all             # both, on the same cluster
#   FOCUS='Aggregator' make conformance   # a subset (a regular expression on spec names)
#   POD_SECURITY=Baseline make conformance  # nodes at nestplane's default pod security level
#
# Everything is built here from Debian's kubernetes source tree (install-deps prepares it):
# e2e.test, the ginkgo CLI, agnhost, the sample API server; their images by
# `nestplane images build --suite`. Prints `N passed, M failed` and the failing names; the
# JUnit reports stay in $OUT (default target/conformance).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-parallel}"
case "$MODE" in
  parallel | serial | all) ;;
  *) echo "conformance: the mode is parallel (default), serial or all" >&2; exit 2 ;;
esac
OUT="${OUT:-$PWD/target/conformance}"
WORKERS="${WORKERS:-4}"
# The suite needs host networking and host paths (KubeletManagedEtcHosts, the node-to-pod
# network checks): its nodes enforce no pod security unless POD_SECURITY=Baseline says so.
POD_SECURITY="${POD_SECURITY:-Privileged}"
STATE="${CONFORMANCE_STATE_DIR:-$OUT/state}"
mkdir -p "$OUT"

bin_line=$(NESTPLANE_E2E_SUITE=1 scripts/install-deps.sh | grep '^NESTPLANE_BIN_DIR=')
export "${bin_line?}"
export PATH="$NESTPLANE_BIN_DIR:$PATH"
# Where install-deps puts the suite, whatever NESTPLANE_BIN_DIR says.
E2E_DIR="${NESTPLANE_CACHE_DIR:-$HOME/.cache/nestplane}/kubernetes/v1.20.2/e2e"
[ -x "$E2E_DIR/e2e.test" ] && [ -x "$E2E_DIR/ginkgo" ] && [ -x "$E2E_DIR/kubectl" ] || {
  echo "conformance: e2e.test, ginkgo or kubectl missing in $E2E_DIR" >&2
  exit 1
}

echo "conformance: building nestplane (release) and the images" >&2
cargo build --release -p nestplane-cli
NP="$PWD/target/release/nestplane"
"$NP" images build --suite >/dev/null

# The suite's images, under the names 1.20's suite asks for (registries mapped below).
images=(
  k8s.gcr.io/e2e-test-images/agnhost:2.21
  gcr.io/kubernetes-e2e-test-images/sample-apiserver:1.17
  registry.k8s.io/etcd:3.4.13-0
  docker.io/library/busybox:1.29
  docker.io/library/httpd:2.4.38-alpine
  docker.io/library/httpd:2.4.39-alpine
  docker.io/library/nginx:1.14-alpine
  docker.io/library/nginx:1.15-alpine
  gcr.io/kubernetes-e2e-test-images/nonewprivs:1.0
  gcr.io/kubernetes-e2e-test-images/nonroot:1.0
  gcr.io/kubernetes-e2e-test-images/kitten:1.0
  gcr.io/kubernetes-e2e-test-images/nautilus:1.0
  gcr.io/kubernetes-e2e-test-images/jessie-dnsutils:1.0
)
node_images=()
for i in "${images[@]}"; do node_images+=(--node-image "$i"); done

rm -rf "$STATE"
mkdir -p "$STATE"
echo "conformance: nestplane up --nodes 2 (state in $STATE)" >&2
"$NP" up --state-dir "$STATE" --nodes 2 --timeout 600 --pod-security "$POD_SECURITY" "${node_images[@]}" \
  >"$OUT/up.log" 2>&1 &
UP=$!
cleanup() {
  kill "$UP" 2>/dev/null || true
  wait "$UP" 2>/dev/null || true
}
trap cleanup EXIT
KC="$STATE/demo.kubeconfig"
ready=0
for _ in $(seq 1 600); do
  if [ -s "$KC" ] && kubectl --kubeconfig "$KC" get nodes 2>/dev/null | grep -c ' Ready' | grep -q 2; then
    ready=1
    break
  fi
  kill -0 "$UP" 2>/dev/null || { tail -n 30 "$OUT/up.log" >&2; exit 1; }
  sleep 1
done
[ "$ready" = 1 ] || { echo "conformance: the 2 nodes are not Ready after 600 s" >&2; tail -n 30 "$OUT/up.log" >&2; exit 1; }
kubectl --kubeconfig "$KC" get nodes

# Registries: the suite's defaults, except those nestplane's images are named under.
cat >"$OUT/repo-list.yaml" <<EOF
gcRegistry: registry.k8s.io
EOF
export KUBE_TEST_REPO_LIST="$OUT/repo-list.yaml"

# [Conformance] ends every spec's name, so FOCUS comes before it.
FOCUS_RE="${FOCUS:+($FOCUS).*}\\[Conformance\\]"
if [ -n "${FOCUS:-}" ]; then
  SERIAL_RE="(\\[Serial\\].*($FOCUS)|($FOCUS).*\\[Serial\\]).*\\[Conformance\\]"
else
  SERIAL_RE="\\[Serial\\].*\\[Conformance\\]"
fi

# One pass of the suite: `parallel` (the non-[Serial] specs, $WORKERS ginkgo workers) or
# `serial` (the [Serial] ones, one at a time, with the two that are also [Disruptive]: they
# taint this fresh cluster's nodes). Reports in $OUT/report-<pass>-<level>.
run_pass() {
  local pass="$1" report="$OUT/report-$1-$POD_SECURITY" log="$OUT/$1-$POD_SECURITY.log"
  rm -rf "$report"
  mkdir -p "$report"
  echo "conformance: $pass specs (log in $log)" >&2
  local start=$SECONDS
  set +e
  if [ "$pass" = serial ]; then
    "$E2E_DIR/e2e.test" --provider=skeleton --kubeconfig="$KC" --kubectl-path="$E2E_DIR/kubectl" \
      --ginkgo.focus="$SERIAL_RE" \
      --report-dir="$report" --ginkgo.noColor >"$log" 2>&1
  else
    "$E2E_DIR/ginkgo" -nodes="$WORKERS" -noColor "$E2E_DIR/e2e.test" -- \
      --provider=skeleton --kubeconfig="$KC" --kubectl-path="$E2E_DIR/kubectl" \
      --ginkgo.focus="$FOCUS_RE" --ginkgo.skip='\[Serial\]|\[Disruptive\]' \
      --report-dir="$report" >"$log" 2>&1
  fi
  local rc=$?
  set -e
  # Count from the JUnit reports: a testcase with <failure> failed, with <skipped> was skipped.
  python3 - "$report" "$((SECONDS - start))" "$pass" "$rc" <<'EOF' || status=1
import glob, sys, xml.etree.ElementTree as ET
passed, failed, names = 0, 0, []
reports = glob.glob(sys.argv[1] + "/junit*.xml")
if not reports:
    print(f"{sys.argv[3]}: no report: the suite exited with {sys.argv[4]} before running a spec")
    sys.exit(1)
for f in reports:
    for tc in ET.parse(f).getroot().iter("testcase"):
        if tc.find("skipped") is not None:
            continue
        if tc.find("failure") is not None:
            failed += 1
            names.append(tc.get("name"))
        else:
            passed += 1
print(f"{sys.argv[3]}: {passed} passed, {failed} failed in {int(sys.argv[2]) // 60} min")
for n in sorted(names):
    print("FAILED:", n)
sys.exit(1 if failed or sys.argv[4] != "0" else 0)
EOF
}

# Exits non-zero when a spec failed or the suite did not run.
status=0
if [ "$MODE" = all ]; then
  run_pass parallel
  run_pass serial
else
  run_pass "$MODE"
fi
exit "$status"
