#!/usr/bin/env bash
# Checks the dependency tree with cargo-deny (deny.toml): known advisories, banned or
# duplicated crates, licenses, and sources. Run by the test command.
#
# The RustSec advisory database: fetched live where GitHub can be reached; otherwise a copy
# already on the machine: NESTPLANE_ADVISORY_DB if set, else ../shared/advisory-db beside the
# checkout, else /work/shared/advisory-db. cargo-deny opens a database only as a git
# repository, so a copy is committed once into target/advisory-dbs, dated by its newest
# advisory (so its age shows), and a copy older than 90 days is reported.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE_DIR="${NESTPLANE_CACHE_DIR:-$HOME/.cache/nestplane}"
DENY="$CACHE_DIR/bin/cargo-deny"
[ -x "$DENY" ] || { echo "deny: $DENY not found: run scripts/install-deps.sh" >&2; exit 1; }

# Where deny.toml's db-path points, under the name cargo-deny gives the default database.
DB_ROOT=target/advisory-dbs
DB="$DB_ROOT/advisory-db-3157b0e258782691"
mkdir -p "$DB_ROOT"
# One run at a time in a checkout.
exec 9>"$DB_ROOT/.lock"
flock 9

rm -rf "$DB.new"
if GIT_TERMINAL_PROMPT=0 timeout 60 git -c http.lowSpeedLimit=1000 -c http.lowSpeedTime=15 \
    clone -q --depth 1 https://github.com/RustSec/advisory-db "$DB.new" 2>/dev/null; then
  source="the live database"
else
  rm -rf "$DB.new"
  copy=""
  for c in "${NESTPLANE_ADVISORY_DB:-}" ../shared/advisory-db /work/shared/advisory-db; do
    if [ -n "$c" ] && [ -d "$c/crates" ]; then copy="$c"; break; fi
  done
  if [ -z "$copy" ]; then
    echo "deny: GitHub is out of reach and no copy of the RustSec advisory database was found;" \
      "set NESTPLANE_ADVISORY_DB to one (a checkout of github.com/RustSec/advisory-db)" >&2
    exit 1
  fi
  cp -r "$copy" "$DB.new"
  chmod -R u+w "$DB.new"
  rm -rf "$DB.new/.git"
  newest=$(grep -rhs '^date = "' "$DB.new/crates" | sort | tail -n1 | cut -d'"' -f2) || true
  newest=${newest:-1970-01-01}
  (cd "$DB.new" && git init -q && git add -A \
    && GIT_AUTHOR_DATE="${newest}T00:00:00Z" GIT_COMMITTER_DATE="${newest}T00:00:00Z" \
      git -c user.name=nestplane -c user.email=nestplane@invalid commit -q -m "copy of $copy")
  age=$(( ( $(date +%s) - $(date -d "$newest" +%s) ) / 86400 ))
  source="the copy in $copy (newest advisory $newest, $age days ago)"
  if [ "$age" -gt 90 ]; then
    echo "deny: warning: the advisory database copy is $age days old; advisories published" \
      "since are not checked (a machine that reaches GitHub uses the live one)" >&2
  fi
fi
rm -rf "$DB" && mv "$DB.new" "$DB"
echo "deny: advisories from $source"

# cargo-deny reads `cargo metadata`, which needs every target's crates downloaded.
cargo fetch --quiet
"$DENY" --offline check advisories bans licenses sources
