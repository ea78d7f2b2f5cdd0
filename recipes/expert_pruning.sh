#!/usr/bin/env bash
# Expert pruning measured on the main job's corpus (8 dialects -> 1 target language): for each dialect,
# the MoE pruned for that dialect to each keep fraction against the full model, against global pruning
# (every dialect's statistics together) and against random pruning (SEEDS draws) at the same sizes.
#
#   bash recipes/expert_pruning.sh                 # the main job's MoE (trained once, reused), then pruning
#   TINY=1 WORK=/tmp/w bash recipes/expert_pruning.sh   # the same pipeline on the tiny corpus (what the tests run)
#
# Pipeline: recipes/main.sh with its dense baselines off (skipped where its outputs are up to date);
# routing statistics of the MoE on the valid split by dialect (fairseq-generate --moe-routing-stats
# --moe-routing-stats-groups); `python -m fairseq_moe_ext.checkpoint prune` per dialect, global and
# random; fairseq-generate in one process from every pruned set; sacreBLEU per dialect
# (recipes/prune_by_dialect.py).
#
# Outputs (under WORK/pruning): table.md, results.json, pruning.png, routing_valid.json (the
# statistics), sets/ (the pruned sets), generate/ (every fairseq-generate output).
#
# Knobs (environment variables; defaults in brackets), besides the main job's (recipes/main.sh):
#   WORK [./work-dirs/main]   the main job's output directory
#   FRACTIONS ["0.5 0.25"]    keep fractions    SEEDS [3]  random prunings per fraction
#   METRIC [gate-mass]        top1, topk or gate-mass: what ranks the experts
#   RATIOS [""]               encoder:decoder ratios R (prune --encoder-decoder-ratio) to measure per-dialect
#                             and global pruning at too, e.g. "0.333 0.6 1.667 3": a second table, budgets.md
set -euo pipefail
cd "$(dirname "$0")/.."
: "${WORK:=./work-dirs/main}" "${FRACTIONS:=0.5 0.25}" "${SEEDS:=3}" "${METRIC:=gate-mass}" "${RATIOS:=}"
if [ "${TINY:-0}" = 1 ]; then : "${BEAM:=2}"; fi
: "${BEAM:=5}"
export WORK BEAM
DENSE=0 DENSE_MATCHED=0 bash recipes/main.sh
source recipes/lib/venv.sh
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore} OMP_NUM_THREADS=${THREADS:-1} MKL_NUM_THREADS=${THREADS:-1}
echo
echo "==> expert pruning by dialect (keep fractions $FRACTIONS, $SEEDS random seeds, metric $METRIC)"
# shellcheck disable=SC2086  # FRACTIONS and RATIOS are lists
python recipes/prune_by_dialect.py --work "$WORK" --out "$WORK/pruning" --fractions $FRACTIONS --seeds "$SEEDS" \
  --metric "$METRIC" --beam "$BEAM" --ratios $RATIOS
