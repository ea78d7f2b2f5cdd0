#!/usr/bin/env bash
# Expert pruning measured on the main job's corpus (8 dialects -> 1 target language): for each dialect,
# the MoE pruned for that dialect to each keep fraction against the full model, against global pruning
# (every dialect's statistics together) and against random pruning (SEEDS draws) at the same sizes.
#
#   bash recipes/expert_pruning.sh                 # the main job's MoE (trained once, reused), then pruning
#   TINY=1 WORK=/tmp/w bash recipes/expert_pruning.sh   # the same pipeline on the tiny corpus (what the tests run)
#   bash recipes/expert_pruning.sh --heal          # then heal each dialect's pruned set: distil it from the full set
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
# --heal (or HEAL=1): recipes/heal_pruned.py trains each dialect's pruned set on that dialect's sentences for
#   HEAL_UPDATES [200; TINY 4] updates with --criterion moe_distillation from the full set (lr HEAL_LR [1e-3], warmup
#   HEAL_WARMUP [20; TINY 2], DISTILL_WEIGHT [0.5], DISTILL_TEMPERATURE [1], on WORKERS [2] workers), and with the
#   labels alone (HEAL_PLAIN [1]), then generates its test sentences: healed.md, healed.json; HEAL_DIALECTS [all]
#   heals only these dialects' sets (e.g. "harbor lowland"; the mean is theirs)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${WORK:=./work-dirs/main}" "${FRACTIONS:=0.5 0.25}" "${SEEDS:=3}" "${METRIC:=gate-mass}" "${RATIOS:=}"
for arg in "$@"; do
  case $arg in
    --heal) HEAL=1 ;;
    *) echo "$0: unknown argument $arg (--heal, or none)" >&2; exit 2 ;;
  esac
done
if [ "${TINY:-0}" = 1 ]; then : "${BEAM:=2}" "${HEAL_UPDATES:=4}" "${HEAL_WARMUP:=2}"; fi
: "${BEAM:=5}"
export WORK BEAM
DENSE=0 DENSE_MATCHED=0 bash recipes/main.sh
source recipes/lib/venv.sh
source recipes/lib/common.sh
# WORK/pruning made from another training of the MoE, ranked by another METRIC or generated with another BEAM goes.
made_for "$WORK/pruning" "$(cat "$WORK/moe/.trained") metric=$METRIC beam=$BEAM"
export PYTHONWARNINGS=${PYTHONWARNINGS:-ignore} OMP_NUM_THREADS=${THREADS:-1} MKL_NUM_THREADS=${THREADS:-1}
echo
echo "==> expert pruning by dialect (keep fractions $FRACTIONS, $SEEDS random seeds, metric $METRIC)"
# shellcheck disable=SC2086  # FRACTIONS and RATIOS are lists
python recipes/prune_by_dialect.py --work "$WORK" --out "$WORK/pruning" --fractions $FRACTIONS --seeds "$SEEDS" \
  --metric "$METRIC" --beam "$BEAM" --ratios $RATIOS
if [ "${HEAL:-0}" = 1 ]; then
  echo
  echo "==> healing the per-dialect sets: distilled from the full set for ${HEAL_UPDATES:=200} updates on each dialect"
  heal_flags=(); [ "${HEAL_PLAIN:-1}" = 1 ] || heal_flags=(--no-plain)
  # shellcheck disable=SC2206  # HEAL_DIALECTS is a list
  [ -z "${HEAL_DIALECTS:-}" ] || heal_flags+=(--dialects ${HEAL_DIALECTS})
  # shellcheck disable=SC2086  # FRACTIONS is a list
  python recipes/heal_pruned.py --work "$WORK" --pruning "$WORK/pruning" --fractions $FRACTIONS \
    --updates "$HEAL_UPDATES" --lr "${HEAL_LR:-1e-3}" --warmup "${HEAL_WARMUP:-20}" --weight "${DISTILL_WEIGHT:-0.5}" \
    --temperature "${DISTILL_TEMPERATURE:-1}" --workers "${WORKERS:-2}" --beam "$BEAM" "${heal_flags[@]}"
fi
