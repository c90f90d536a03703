#!/usr/bin/env bash
# Make ab_base/tritium_base: the package as of git revision REV (default HEAD), importable next
# to this tree's tritium, for scripts/ab_linear.py. ab_base/ is ignored by git; carry it to the
# GPU machine (run's carry: ["ab_base"]).
set -euo pipefail
rev=${1:-HEAD}
cd "$(dirname "$0")/.."
rm -rf ab_base && mkdir -p ab_base
git archive "$rev" tritium | tar -x -C ab_base
mv ab_base/tritium ab_base/tritium_base
echo "ab_base/tritium_base = tritium at $(git rev-parse --short "$rev")"
