#!/usr/bin/env bash
# Make ab_base/tritium_<rev>: the package as of git revision REV, importable next to this
# tree's tritium, for scripts/ab_linear.py (which times every ab_base/tritium_* it finds).
# ab_base/ is ignored by git; carry it to the GPU machine (run's carry: ["ab_base"]).
#   scripts/ab_base.sh REV [REV ...]      (no REV: clears ab_base/)
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf ab_base && mkdir -p ab_base
for rev in "$@"; do
  name=tritium_$(git rev-parse --short "$rev")
  git archive "$rev" tritium | tar -x -C ab_base
  mv ab_base/tritium "ab_base/$name"
  echo "ab_base/$name"
done
