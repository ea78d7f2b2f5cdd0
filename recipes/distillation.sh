#!/usr/bin/env bash
# Distillation measured on the main job's corpus: one command reruns each table of docs/recipes.md "Distillation".
#
#   bash recipes/distillation.sh students   # (a) a dense student of the MoE's active size (recipes/main.sh's
#                                           #     dense_matched shape) distilled from the MoE, word-level and
#                                           #     sequence-level, against the same model from scratch, STUDENT_SEEDS seeds
#   bash recipes/distillation.sh healed     # (b) the 50% and 25% per-dialect pruned sets healed by distillation
#                                           #     from the full set, against not (= bash recipes/expert_pruning.sh --heal)
#   bash recipes/distillation.sh cost       # (c) words per second of word-level distillation against plain training
#   TINY=1 WORK=/tmp/w bash recipes/distillation.sh all   # every table on the tiny corpus (what the tests run)
#
# The teacher is the main job's MoE (recipes/main.sh, run first with its dense baselines off and skipped where up to
# date): a per-rank set saved by WORKERS workers, whose experts the students' WORKERS training workers share out
# (--distill-teacher-experts auto). Sequence-level: recipes/seq_distill_data.py translates the training source side
# with the teacher (beam BEAM, GEN_WORKERS workers: sharded generation), SHARD_LINES sentences per shard, a finished
# shard never generated again, and binarises its outputs with the job's dictionaries; the student trains on them.
# Every table says when it was measured, on how many cores, the load average before and after, and its command.
# Outputs (WORK/distillation): students.md/.json, cost.md/.json, runs/<name>/ (train.log, ckpt/, generate.out,
# bleu.json), seq_data/ (shards/, bin/); (b) writes WORK/pruning/healed.md (recipes/heal_pruned.py).
#
# Knobs (environment; defaults in brackets), besides the main job's (recipes/main.sh) and expert_pruning.sh's:
#   WORK [./work-dirs/main]   STUDENT_SEEDS ["1 2 3"; TINY "1"]   DISTILL_WEIGHT [0.5]   DISTILL_TEMPERATURE [1]
#   DISTILL_TOP_K [0]   SHARD_LINES [2000; TINY 40]   GEN_WORKERS [WORKERS]   COST_UPDATES [100; TINY 4]
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/lib/common.sh
TABLE=${1:-}
case $TABLE in
  students | healed | cost | all) ;;
  *) echo "$0: name the table to (re)run: students, healed, cost or all" >&2; exit 2 ;;
esac
if [ "${TINY:-0}" = 1 ]; then : "${STUDENT_SEEDS:=1}" "${SHARD_LINES:=40}" "${COST_UPDATES:=4}" "${BEAM:=2}"; fi
: "${WORK:=./work-dirs/main}" "${STUDENT_SEEDS:=1 2 3}" "${DISTILL_WEIGHT:=0.5}" "${DISTILL_TEMPERATURE:=1}" "${DISTILL_TOP_K:=0}"
: "${SHARD_LINES:=2000}" "${COST_UPDATES:=100}" "${BEAM:=5}" "${WORKERS:=2}"
: "${GEN_WORKERS:=$WORKERS}"
export WORK BEAM WORKERS
command_line="$(env | grep -E '^(TINY|SEEDS|STUDENT_SEEDS|DISTILL_[A-Z_]+|SHARD_LINES|GEN_WORKERS|COST_UPDATES|HEAL_[A-Z]+|FRACTIONS|WORK|DIALECTS|MAX_UPDATE|WORKERS|BEAM|EXPERTS|TOPK|SEED)=' \
  | sort | tr '\n' ' ')bash recipes/distillation.sh $TABLE"
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }
before=$(loadavg)

if [ "$TABLE" = healed ] || [ "$TABLE" = all ]; then
  bash recipes/expert_pruning.sh --heal  # the main job, the pruned sets, then healing (recipes/heal_pruned.py)
fi
DENSE=0 DENSE_MATCHED=0 bash recipes/main.sh
STAGES=3
echo "==> [1/$STAGES] environment"
setup_environment
OUT=$WORK/distillation
mkdir -p "$OUT/runs"
mapfile -t common < "$WORK/common_args.txt"  # the job's flags, its data directory first
mapfile -t dense < "$WORK/dense_matched_args.txt"  # the dense model of the MoE's active size
teacher=$WORK/moe/ckpt/checkpoint_best.pt
teacher_sig=$(cat "$WORK/moe/.trained")  # its training's knobs: what the teacher teaches changes with them
distil=(--criterion moe_distillation --distill-teacher "$teacher" --distill-weight "$DISTILL_WEIGHT"
        --distill-temperature "$DISTILL_TEMPERATURE" --distill-top-k "$DISTILL_TOP_K")

# student NAME DATA ARGS...: the dense student trained on DATA (skipped where trained with these flags), then the test
# set generated in one process (skipped where generated from that training) and scored per dialect.
student() {
  local name=$1 data=$2; shift 2
  local dir=$OUT/runs/$name sig="${common[*]:1} ${dense[*]} $data $*"
  case "$data $*" in *seq_data* | *--distill-teacher*) sig+=" teacher: $teacher_sig" ;; esac
  if needs_run "$dir/.trained" "$sig"; then
    rm -rf "$dir"
    train_workers "$WORKERS" "$dir/train.log" "$data" "${common[@]:1}" "${dense[@]}" "$@" --save-dir "$dir/ckpt" \
      > /dev/null
    mark_done "$dir/.trained" "$sig"
  fi
  [ "${GENERATE:-1}" = 1 ] || return 0
  if needs_run "$dir/.generated" "$sig beam=$BEAM"; then
    fairseq_tool generate "$WORK/data/bin" --user-dir "$USER_DIR" --path "$dir/ckpt/checkpoint_best.pt" --cpu \
      --gen-subset test --beam "$BEAM" --batch-size 128 --remove-bpe sentencepiece --num-workers 0 \
      > "$dir/generate.out" 2> "$dir/generate.log"
    mark_done "$dir/.generated" "$sig beam=$BEAM"
  fi
  python recipes/score_translations.py "$dir/generate.out" --ref "$WORK/data/raw/test.tgt" \
    --domains "$WORK/data/raw/test.domain" --json-out "$dir/bleu.json" --name "$name" | sed 's/^/    /'
}

if [ "$TABLE" = students ] || [ "$TABLE" = all ]; then
  stage 2 "students: from scratch, word-level and sequence-level distilled, seeds $STUDENT_SEEDS"
  for seed in $STUDENT_SEEDS; do
    student "scratch_$seed" "${common[0]}" --seed "$seed"
    student "word_$seed" "${common[0]}" --seed "$seed" "${distil[@]}"
  done
  echo "    the teacher's beam outputs of the training source side ($SHARD_LINES sentences per shard)"
  made_for "$OUT/seq_data" "$teacher_sig beam=$BEAM"  # shards of another teacher or beam are made again
  python recipes/seq_distill_data.py --tok "$WORK/data/tok" --dicts "$WORK/data/bin" --teacher "$teacher" \
    --out "$OUT/seq_data" --shard-lines "$SHARD_LINES" --beam "$BEAM" --workers "$GEN_WORKERS" | sed 's/^/    /'
  for seed in $STUDENT_SEEDS; do
    student "seq_$seed" "$OUT/seq_data/bin" --seed "$seed"
  done
  # shellcheck disable=SC2086  # STUDENT_SEEDS is a list
  python recipes/distill_tables.py students --work "$WORK" --seeds $STUDENT_SEEDS --load-before "$before" \
    --load-after "$(loadavg)" --command "$command_line"
fi

if [ "$TABLE" = cost ] || [ "$TABLE" = all ]; then
  stage 3 "cost: $COST_UPDATES updates of the dense student, plain and distilled, on $WORKERS workers"
  for kind in plain distilled; do
    extra=(); [ "$kind" = plain ] || extra=("${distil[@]}")
    GENERATE=0 student "cost_$kind" "${common[0]}" --seed 1 --max-update "$COST_UPDATES" --no-save "${extra[@]}"
  done
  python recipes/distill_tables.py cost --work "$WORK" --load-before "$before" --load-after "$(loadavg)" \
    --command "$command_line"
fi
if [ "$TABLE" = healed ] || [ "$TABLE" = all ]; then
  python recipes/distill_tables.py healed --work "$WORK" --load-before "$before" --load-after "$(loadavg)" \
    --command "$command_line"
fi
finish
