#!/usr/bin/env bash
# Issue 46 measured on the main job (recipes/main.sh): the balance loss per micro-batch against over the
# whole update (--moe-balance-scope micro-batch | global-batch) with --update-freq 4, and a fine-tune of the
# main job's MoE to one dialect with the router trained or frozen (--moe-freeze router).
#
#   bash recipes/balance_scope_freeze.sh                         # 3 seeds x 2 scopes + 2 fine-tunes: about 15 min per
#                                                                # run on a busy 2-core machine (7 Dec 2026)
#   SEEDS=1 bash recipes/balance_scope_freeze.sh                 # one seed
#   TINY=1 WORK=/tmp/b bash recipes/balance_scope_freeze.sh      # the same pipeline in a few minutes (what the tests run)
#
# Each (seed, scope) is recipes/main.sh without its dense baselines (DENSE=0 DENSE_MATCHED=0) and with
# MOE_FLAGS="--update-freq UPDATE_FREQ --moe-balance-scope SCOPE", in WORK/seedS/SCOPE: BLEU (moe/bleu.json),
# valid loss (moe/train.log) and the mutual information of dialect and first-choice expert per MoE layer
# (routing.json, recipes/routing_by_domain.py). The fine-tunes start from the first seed's micro-batch run
# (its checkpoint_best, --reset-optimizer and the other resets) and train FT_UPDATES updates on FT_DIALECT's
# training pairs alone, once with every part training and once with --moe-freeze router; each is scored on the
# whole test set, per dialect (forgetting: the other dialects). recipes/summarize_balance_freeze.py prints the
# tables (WORK/tables.txt).
#
# Knobs (environment variables; defaults in brackets), besides every knob of recipes/main.sh:
#   WORK [./work-dirs/balance_scope_freeze]   output directory
#   TINY [0]              1: main.sh's tiny corpus and a few updates
#   SEEDS [1 2 3]         seeds, one pair of runs each (TINY: 1)
#   UPDATE_FREQ [4]       micro-batches per update
#   MAX_UPDATE [150]      updates per run (150 x 4 micro-batches: the main job's 600 micro-batches)
#   FT_DIALECT [harbor]   the dialect fine-tuned on
#   WARMUP [25]           warm-up updates (main.sh's 100 over 600 updates, scaled to 150 updates of 4 micro-batches)
#   FT_UPDATES [100]      fine-tuning updates (TINY: 4)   FT_LR [5e-4]   fine-tuning learning rate
#   FINETUNE [1]          0: skip the fine-tunes (e.g. SEEDS="2 3" FINETUNE=0 adds seeds to a finished WORK)
#   SCOPE_RUNS [1]        0: skip the scope runs (e.g. to fine-tune another main job's MoE: FT_FROM)
#   FT_FROM [WORK/seedS/micro-batch, S the first seed]   a recipes/main.sh WORK to fine-tune the MoE of
#                         (its moe/ckpt/checkpoint_best.pt, data/ and moe/bleu.json)
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/lib/common.sh

: "${WORK:=./work-dirs/balance_scope_freeze}" "${TINY:=0}" "${UPDATE_FREQ:=4}" "${FT_DIALECT:=harbor}" "${FT_LR:=5e-4}"
if [ "$TINY" = 1 ]; then
  : "${SEEDS:=1}" "${FT_UPDATES:=4}" "${MAX_UPDATE:=6}"
fi
: "${SEEDS:=1 2 3}" "${FT_UPDATES:=100}" "${MAX_UPDATE:=150}" "${WORKERS:=2}" "${FINETUNE:=1}" "${SCOPE_RUNS:=1}"
[ "$TINY" = 1 ] || : "${WARMUP:=25}"
export TINY MAX_UPDATE WORKERS DENSE=0 DENSE_MATCHED=0 ${WARMUP:+WARMUP}
STAGES=4
echo "==> [1/$STAGES] environment"
setup_environment
echo "    WORK=$WORK  seeds=$SEEDS  update_freq=$UPDATE_FREQ  max_update=$MAX_UPDATE  fine-tune: $FT_DIALECT, $FT_UPDATES updates"

stage 2 "main job per seed and balance scope (recipes/main.sh, --update-freq $UPDATE_FREQ)"
[ "$SCOPE_RUNS" = 1 ] || SCOPE_SEEDS=
for seed in ${SCOPE_SEEDS-$SEEDS}; do
  for scope in micro-batch global-batch; do
    run=$WORK/seed$seed/$scope
    echo "    seed $seed, $scope: $run.log"
    mkdir -p "$WORK/seed$seed"
    WORK=$run SEED=$seed MOE_FLAGS="--update-freq $UPDATE_FREQ --moe-balance-scope $scope" \
      bash recipes/main.sh > "$run.log" 2>&1 || { tail -n 30 "$run.log"; exit 1; }
    grep -E "^test BLEU" "$run/summary.txt" | sed "s/^/    /" || true
  done
done

if [ "$FINETUNE" != 1 ]; then
  stage 3 "fine-tunes skipped (FINETUNE=$FINETUNE)"
  stage 4 "tables"
  python recipes/summarize_balance_freeze.py "$WORK" --dialect "$FT_DIALECT" | tee "$WORK/tables.txt"
  finish
  exit 0
fi
first=$(echo "$SEEDS" | awk '{print $1}')
base=${FT_FROM:-$WORK/seed$first/micro-batch}
data=$base/data
stage 3 "fine-tune $base's MoE on $FT_DIALECT alone ($FT_UPDATES updates): router trained or frozen"
ft_data=$WORK/finetune/data
mkdir -p "$WORK/finetune" && echo "$base" > "$WORK/finetune/from.txt"
if needs_run "$ft_data/.done" "$FT_DIALECT $(cat "$data/tok/.done")"; then
  rm -rf "$ft_data" && mkdir -p "$ft_data/tok"
  for side in src tgt; do
    paste -d '\t' "$data/raw/train.domain" "$data/tok/train.$side" | awk -F '\t' -v d="$FT_DIALECT" '$1 == d' \
      | cut -f 2- > "$ft_data/tok/train.$side"
  done
  fairseq_tool preprocess --source-lang src --target-lang tgt --trainpref "$ft_data/tok/train" --destdir "$ft_data/bin" \
    --srcdict "$data/bin/dict.src.txt" --tgtdict "$data/bin/dict.tgt.txt" --workers 2 > "$ft_data/preprocess.log" 2>&1
  for f in "$data"/bin/valid.* "$data"/bin/test.*; do ln -sf "$f" "$ft_data/bin/"; done
  mark_done "$ft_data/.done" "$FT_DIALECT $(cat "$data/tok/.done")"
fi
echo "    $(wc -l < "$ft_data/tok/train.src") $FT_DIALECT training pairs"
read -r -a model_args <<< "$(python recipes/checkpoint_flags.py "$base/moe/ckpt/checkpoint_best.pt")"
for freeze in none router; do
  dir=$WORK/finetune/$freeze
  flags=()
  [ "$freeze" = none ] || flags=(--moe-freeze "$freeze")
  rm -rf "$dir"
  train_workers "$WORKERS" "$dir/train.log" "$ft_data/bin" --user-dir "$USER_DIR" --cpu --ddp-backend legacy_ddp \
    --seed "$first" --arch moe_transformer "${model_args[@]}" "${flags[@]}" --dropout 0.1 \
    --criterion moe_label_smoothed_cross_entropy --label-smoothing 0.1 --moe-gate-loss-wt "${GATE_LOSS_WT:-0.01}" \
    --optimizer adam --adam-betas "(0.9, 0.98)" --lr "$FT_LR" --lr-scheduler inverse_sqrt --warmup-updates 10 \
    --clip-norm 1.0 --max-tokens "${MAX_TOKENS:-2048}" --max-update "$FT_UPDATES" --disable-validation \
    --restore-file "$base/moe/ckpt/checkpoint_best.pt" --reset-optimizer --reset-dataloader --reset-meters \
    --reset-lr-scheduler --no-epoch-checkpoints --num-workers 0 --log-format json --log-interval 10 \
    --save-dir "$dir/ckpt" > /dev/null
  fairseq_tool generate "$data/bin" --user-dir "$USER_DIR" --path "$dir/ckpt/checkpoint_last.pt" --cpu \
    --gen-subset test --beam "${BEAM:-5}" --batch-size 128 --remove-bpe sentencepiece --num-workers 0 \
    > "$dir/generate.out" 2> "$dir/generate.log"
  python recipes/score_translations.py "$dir/generate.out" --ref "$data/raw/test.tgt" \
    --domains "$data/raw/test.domain" --hyp-out "$dir/hyp.txt" --json-out "$dir/bleu.json" --name "finetune $freeze"
done

stage 4 "tables"
python recipes/summarize_balance_freeze.py "$WORK" --dialect "$FT_DIALECT" | tee "$WORK/tables.txt"
finish
