#!/usr/bin/env bash
# Install everything nestplane needs on a Debian machine (idempotent, safe to re-run).
#
#  - Debian packages: etcd (server + client), openssl (tests read certificates), Go, rsync,
#    build tools;
#  - Debian packages for cluster DNS: dnsmasq-base (a resolver the tests run) and dnsperf;
#  - Debian packages for real nodes: containerd, runc, the CNI plugins, buildah (images),
#    busybox-static (the shell image), iptables and conntrack (kube-proxy);
#  - kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kube-proxy 1.20.2,
#    built from Debian's `kubernetes` source package, cached under $NESTPLANE_CACHE_DIR
#    (default ~/.cache/nestplane). Nothing is built when the binaries are already cached, or
#    when NESTPLANE_BIN_DIR points at a directory that already holds them (any version).
#
# Prints the directory holding the binaries as its last line: `NESTPLANE_BIN_DIR=<dir>`.
set -euo pipefail

K8S_VERSION=1.20.2
CACHE_DIR="${NESTPLANE_CACHE_DIR:-$HOME/.cache/nestplane}"
BIN_DIR_DEFAULT="$CACHE_DIR/kubernetes/v$K8S_VERSION/bin"
SERVER_BINS=(kube-apiserver kube-controller-manager kube-scheduler)
NODE_BINS=(kubelet kube-proxy)
ALL_BINS=("${SERVER_BINS[@]}" "${NODE_BINS[@]}")

log() { echo "install-deps: $*" >&2; }

have_bins() {
  local dir="$1" b
  for b in "${ALL_BINS[@]}"; do [ -x "$dir/$b" ] || return 1; done
}

# Runs a long command with its output in a log file, printing a line every 30 s so that a
# person watching knows it is alive.
with_progress() {
  local what="$1" logfile="$2"; shift 2
  local start=$SECONDS
  "$@" >"$logfile" 2>&1 &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 5
    if (( (SECONDS - start) % 30 < 5 )) && kill -0 "$pid" 2>/dev/null; then
      log "$what: $((SECONDS - start)) s so far ($(tail -n1 "$logfile" | cut -c1-80))"
    fi
  done
  wait "$pid"
}

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

apt_updated=0
apt_install() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ $apt_updated = 0 ]; then
    log "apt-get update"
    $SUDO apt-get update -qq
    apt_updated=1
  fi
  log "installing Debian packages: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# 1. Runtime packages: etcd for the management plane and the tenants, etcdctl for checks.
apt_install etcd-server etcd-client ca-certificates openssl
# 1a. Building: protoc, for the etcd client's gRPC definitions (shared datastores).
apt_install protobuf-compiler
# 1b. Real nodes: a container runtime, pod networking, image building, a shell image.
apt_install containerd runc containernetworking-plugins buildah busybox-static iptables conntrack \
  gcc libc6-dev
# 1c. Cluster DNS: a resolver the tests run on the machine (names outside a cluster's zone are
# forwarded to it), and dnsperf for the DNS benchmark.
apt_install dnsmasq-base dnsperf
if ! command -v kubectl >/dev/null 2>&1; then
  apt_install kubernetes-client
fi

# 2. Kubernetes server binaries.
if [ -n "${NESTPLANE_BIN_DIR:-}" ] && have_bins "$NESTPLANE_BIN_DIR"; then
  log "using the Kubernetes binaries in NESTPLANE_BIN_DIR=$NESTPLANE_BIN_DIR; nothing to build"
  echo "NESTPLANE_BIN_DIR=$NESTPLANE_BIN_DIR"
  exit 0
fi
if have_bins "$BIN_DIR_DEFAULT"; then
  log "Kubernetes v$K8S_VERSION binaries already cached in $BIN_DIR_DEFAULT; nothing to build"
  echo "NESTPLANE_BIN_DIR=$BIN_DIR_DEFAULT"
  exit 0
fi

# Which binaries are missing from the cache decides what is built (the Go build cache makes a
# later build of the node binaries take about a minute).
want=()
for b in "${ALL_BINS[@]}"; do [ -x "$BIN_DIR_DEFAULT/$b" ] || want+=("$b"); done
log "building ${want[*]} v$K8S_VERSION from Debian's source package (6-8 minutes on 2 cores for all; about 1 minute for kubelet and kube-proxy alone)"
apt_install golang-go rsync make dpkg-dev golang-github-modern-go-reflect2-dev

# deb-src entries are needed for `apt-get source`.
src_list=/etc/apt/sources.list.d/debian.sources
if [ -f "$src_list" ] && ! grep -q '^Types:.*deb-src' "$src_list"; then
  log "enabling Debian source packages in $src_list"
  $SUDO sed -i 's/^Types: deb$/Types: deb deb-src/' "$src_list"
  $SUDO apt-get update -qq
elif [ ! -f "$src_list" ] && ! grep -rqs '^deb-src' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  log "no deb-src entries found; add them so that 'apt-get source kubernetes' works" && exit 1
fi

BUILD_DIR="$CACHE_DIR/kubernetes/build"
SRC="$BUILD_DIR/src"
mkdir -p "$BUILD_DIR"
if [ ! -f "$SRC/.nestplane-prepared" ]; then
  rm -rf "$BUILD_DIR"/* 
  (cd "$BUILD_DIR" && apt-get source --download-only kubernetes 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2)
  dsc=$(ls "$BUILD_DIR"/kubernetes_*.dsc | head -n1)
  case "$dsc" in
    *really$K8S_VERSION*) ;;
    *) log "warning: Debian's kubernetes source is $(basename "$dsc"), expected $K8S_VERSION" ;;
  esac
  (cd "$BUILD_DIR" && dpkg-source -x "$dsc" src >/dev/null)
  # Go 1.19 crashes the 1.20 apiserver with the vendored reflect2 v1.0.1: use Debian's v1.0.2.
  reflect2=/usr/share/gocode/src/github.com/modern-go/reflect2
  [ -d "$reflect2" ] || { log "missing $reflect2"; exit 1; }
  rm -rf "$SRC/vendor/github.com/modern-go/reflect2"
  cp -r "$reflect2" "$SRC/vendor/github.com/modern-go/reflect2"
  mkdir -p "$SRC/.go/src/k8s.io"
  ln -sfn ../../.. "$SRC/.go/src/k8s.io/kubernetes"
  touch "$SRC/.nestplane-prepared"
fi

(
  cd "$SRC"
  export GOPATH="$SRC/.go" CGO_ENABLED=0 GOFLAGS=-mod=vendor GO111MODULE=off
  export PATH="/usr/lib/go/bin:$PATH" HOME="$BUILD_DIR/home" GOCACHE="$BUILD_DIR/gocache"
  mkdir -p "$HOME"
  what=""
  for b in "${want[@]}"; do what="$what cmd/$b"; done
  with_progress "go build" "$BUILD_DIR/build.log" make WHAT="${what# }" \
    || { tail -n 40 "$BUILD_DIR/build.log" >&2; log "build failed; full log in $BUILD_DIR/build.log"; exit 1; }
)

mkdir -p "$BIN_DIR_DEFAULT"
for b in "${want[@]}"; do
  install -m 0755 "$SRC/_output/bin/$b" "$BIN_DIR_DEFAULT/$b.tmp"
  mv "$BIN_DIR_DEFAULT/$b.tmp" "$BIN_DIR_DEFAULT/$b"
done
# Keep the Go build cache (relinks take ~2 minutes) but drop the bulky tree outputs.
rm -rf "$SRC/_output/local/go/pkg" 2>/dev/null || true
log "installed ${want[*]} into $BIN_DIR_DEFAULT"
echo "NESTPLANE_BIN_DIR=$BIN_DIR_DEFAULT"
