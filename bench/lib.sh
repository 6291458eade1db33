# What the bench scripts share (bench/run.sh, tail.sh, stalls.sh): sourced,
# not run. Set BENCH_NAME before sourcing; it prefixes every message.
#
#   die MESSAGE              print "NAME: MESSAGE" and exit 1
#   need TOOL PACKAGE        die unless TOOL is on PATH, naming its package
#   need_two_cores           die on a machine with one core
#   bench_setup              build the release binary ($bin), make a scratch
#                            directory with the demo data ($data), and stop
#                            every process in $pids and remove $data on exit
#   wait_listening OUT LOG [S]  wait (S seconds, default 30, at most) for the
#                            listening line of the `quiver serve` whose stdout
#                            is OUT; set $listen_addr and $admin_addr; on
#                            failure print LOG
#   build_bench_pair BENCH TREE DIR  build the criterion bench BENCH from the
#                            source tree TREE and from this checkout, into
#                            DIR/BENCH-before and DIR/BENCH-after (the
#                            before/after scripts)
BENCH_NAME="${BENCH_NAME:-bench}"

die() { echo "$BENCH_NAME: $*" >&2; exit 1; }

need() { command -v "$1" >/dev/null 2>&1 || die "required tool '$1' is missing (apt-get install $2)"; }

need_two_cores() {
    [ "$(nproc)" -ge 2 ] || die "needs at least 2 cores (server and generator on separate cores)"
}

bench_cleanup() {
    # CONT first: a bench may hold a server stopped (SIGSTOP) between runs,
    # and a stopped process acts on TERM only once continued.
    for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null || true; kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
    rm -rf "$data"
}

# QUIVER_BIN: a prebuilt `quiver` to run instead of building one (on a
# lent machine without a Rust toolchain, carried there).
bench_setup() {
    if [ -n "${QUIVER_BIN:-}" ]; then
        bin="$QUIVER_BIN"
        [ -x "$bin" ] || die "QUIVER_BIN=$bin is not an executable"
    else
        cargo build --release --quiet
        bin="${CARGO_TARGET_DIR:-target}/release/quiver"
    fi
    data="$(mktemp -d)"
    pids=()
    trap bench_cleanup EXIT
    "$bin" demo --data-dir "$data" 2>/dev/null
}

wait_listening() {
    local limit_s="${3:-30}"
    for _ in $(seq $((limit_s * 20))); do grep -q "listening on" "$1" 2>/dev/null && break; sleep 0.05; done
    listen_addr="$(awk '/listening on/ {print $4}' "$1")"
    admin_addr="$(awk '/admin on/ {print $4}' "$1")"
    [ -n "$listen_addr" ] || { cat "$2"; die "server did not start within $limit_s s"; }
}

# The criterion bench $1's executable built from the tree at $2 (into this
# checkout's target directory, so the dependencies compile once).
bench_executable() {
    (cd "$2" && CARGO_TARGET_DIR="$OLDPWD/target" QUIVER_NO_FLATC=1 cargo bench --bench "$1" --no-run \
        --message-format=json 2>/dev/null) |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[1] and m.get("executable"):
        print(m["executable"])' "$1"
}

# Cargo names both builds' executable alike and keeps one fingerprint for
# both (the package's path is not in its hash): each executable is copied
# away before the other build overwrites it, and this tree's sources are
# touched after the base build so that cargo sees them as newer and builds
# them again instead of taking the base's build as fresh.
build_bench_pair() {
    local bench="$1" tree="$2" dir="$3" built
    built="$(bench_executable "$bench" "$tree")"
    [ -x "$built" ] || die "the $bench bench at $tree did not build"
    cp "$built" "$dir/$bench-before"
    find src bench build.rs Cargo.toml -type f -exec touch {} +
    built="$(bench_executable "$bench" .)"
    [ -x "$built" ] || die "the $bench bench of this checkout did not build"
    cp "$built" "$dir/$bench-after"
    if cmp -s "$dir/$bench-before" "$dir/$bench-after"; then
        die "both builds of $bench are one binary"
    fi
}
