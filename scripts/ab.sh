#!/usr/bin/env bash
# One benchmark command under several versions of the package, in turn on one machine: the way to
# compare old and new code (a number from another machine start is no baseline; docs/bench.md).
#
#   scripts/ab.sh prepare COMMIT...          on the development machine: each commit's `loraplex/`
#                                            into .ab/COMMIT (ignored by git; carry `.ab` to the GPU)
#   scripts/ab.sh run PASSES 'CMD' VERSION...  on the GPU machine: CMD in each version's tree,
#                                            PASSES times round; VERSION is a prepared commit or HEAD
#                                            (the working tree). In CMD, $AB_OUT is a directory of its
#                                            own per run (under $OUT when set), $AB_VERSION the version
#                                            and $AB_ROOT the checkout (its scripts and benchmarks).
# e.g. scripts/ab.sh run 2 'python3 -m loraplex.bench.cli kernels --quick --no-sweep --out $AB_OUT' 8f94285 HEAD
# Each run's output goes to $AB_OUT/log; its last line is printed with the version and pass.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
case "${1:-}" in
  prepare)
    shift
    for c in "$@"; do
      rm -rf ".ab/$c" && mkdir -p ".ab/$c" || exit 1
      git archive "$c" loraplex | tar -x -C ".ab/$c" || exit 1
      echo "prepared .ab/$c ($(git log -1 --format='%h %s' "$c" | cut -c1-80))"
    done
    ;;
  run)
    passes=${2:?usage: scripts/ab.sh run PASSES CMD VERSION...}
    cmd=${3:?usage: scripts/ab.sh run PASSES CMD VERSION...}
    shift 3
    for v in "$@"; do
      if [ "$v" != HEAD ] && [ ! -d ".ab/$v/loraplex" ]; then
        echo "no .ab/$v: run 'scripts/ab.sh prepare $v' where git is, and carry .ab" >&2
        exit 2
      fi
    done
    for pass in $(seq 1 "$passes"); do
      for v in "$@"; do
        tree=$root
        [ "$v" != HEAD ] && tree=$root/.ab/$v
        out=${OUT:-$root/bench-results}/ab/$v/pass$pass
        mkdir -p "$out"
        # the tree's own package first on the path: `python -m` runs from the tree's directory
        (cd "$tree" && AB_OUT=$out AB_VERSION=$v AB_ROOT=$root bash -c "$cmd" > "$out/log" 2>&1)
        echo "pass $pass $v rc=$? $(tr '\r' '\n' < "$out/log" | grep -v '^\s*$' | tail -1 | cut -c1-150)"
      done
    done
    ;;
  *)
    echo "usage: scripts/ab.sh prepare COMMIT... | run PASSES CMD VERSION..." >&2
    exit 2
    ;;
esac
