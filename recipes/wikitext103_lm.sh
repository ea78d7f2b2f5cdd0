#!/usr/bin/env bash
# WikiText-103 language model with moe_transformer_lm, following fairseq's
# examples/language_model/README.md: prepare-wikitext-103.sh, word-level fairseq-preprocess
# --only-source, the README's transformer_lm training flags (512-token blocks, update-freq 16 on
# 2 GPUs, fp16, 50k updates), fairseq-eval-lm with a 400-token context window.
#
#   bash recipes/wikitext103_lm.sh              # the real run (downloads; GPUs)
#   bash recipes/wikitext103_lm.sh --dry-run    # same pipeline and flags on a tiny local corpus, 2 CPU workers
#   ARCH=moe_transformer_lm_gpt2_small bash recipes/wikitext103_lm.sh   # GPT-2 small shape
#
# Data: examples/language_model/prepare-wikitext-103.sh from the installed fairseq package (the
#   WikiText-103 v1 zip from s3.amazonaws.com/research.metamind.io; about 103M training tokens, a
#   267k-word vocabulary). Needs wget and unzip. --dry-run writes wiki.*.tokens of the same format.
# Resources: the README assumes 2 GPUs (GPUS=2; UPDATE_FREQ keeps 32 x 2048 tokens per update for
#   any GPU count); fp16 needs Volta or newer. Roughly a day on 2 recent GPUs for 50k updates; the
#   MoE layers add memory for E experts' weights and optimizer state, shared over the GPUs.
# Expected: fairseq's README reports "Loss: 3.4164, Perplexity: 30.46" on the test set for the dense
#   transformer_lm trained with these flags; compare the MoE run with DENSE=1 (same flags, dense model).
#
# Knobs (environment; defaults in brackets):
#   WORK [./work-dirs/wikitext103_lm, --dry-run: ./work-dirs/wikitext103_lm-dry-run]
#   GPUS [2; --dry-run: 2 CPU workers]   ARCH [moe_transformer_lm]   DENSE [0] (1: transformer_lm)
#   EXPERTS [8] TOPK [2] MOE_FREQ [2] CAPACITY_FACTOR [1.25] GATE_LOSS_WT [0.01]
#   MAX_UPDATE [50000] TOKENS_PER_SAMPLE [512] MAX_TOKENS [2048] UPDATE_FREQ [32 / GPUS]
#   LR [0.0005] WARMUP [4000] CONTEXT_WINDOW [400] SEED [1]
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/lib/common.sh
recipe_args "$@"

if [ "$DRY_RUN" = 1 ]; then
  : "${WORK:=./work-dirs/wikitext103_lm-dry-run}" "${MAX_UPDATE:=6}" "${WARMUP:=4}" "${EXPERTS:=4}"
  : "${TOKENS_PER_SAMPLE:=64}" "${MAX_TOKENS:=256}" "${UPDATE_FREQ:=1}" "${CONTEXT_WINDOW:=32}"
fi
: "${WORK:=./work-dirs/wikitext103_lm}" "${GPUS:=2}" "${ARCH:=moe_transformer_lm}" "${DENSE:=0}" "${EXPERTS:=8}"
: "${MAX_UPDATE:=50000}" "${TOKENS_PER_SAMPLE:=512}" "${MAX_TOKENS:=2048}" "${UPDATE_FREQ:=$((GPUS >= 32 ? 1 : 32 / GPUS))}"
: "${LR:=0.0005}" "${WARMUP:=4000}" "${CONTEXT_WINDOW:=400}"
shared_knob_defaults  # TOPK, MOE_FREQ, CAPACITY_FACTOR, GATE_LOSS_WT, SEED (see common.sh)

STAGES=5
echo "==> [1/$STAGES] environment$([ "$DRY_RUN" = 1 ] && echo ' (dry run: tiny local corpus, 2 CPU workers, tiny model)')"
setup_environment
mkdir -p "$WORK/data"  # prepare-wikitext-103.sh runs in it
TEXT=$WORK/data/wikitext-103
BIN=$WORK/data-bin/wikitext-103

stage 2 "data: $([ "$DRY_RUN" = 1 ] && echo "tiny stand-in corpus" || echo "fairseq's prepare-wikitext-103.sh") -> $TEXT"
if [ -s "$TEXT/wiki.test.tokens" ]; then
  echo "    up to date (remove $TEXT to redo)"
elif [ "$DRY_RUN" = 1 ]; then
  python recipes/tiny_corpus.py lm "$TEXT" --sizes 150 10 10
else
  examples=$(fairseq_examples)
  # The script downloads and unzips into its current directory (leaving wikitext-103/ there).
  (cd "$WORK/data" && bash "$examples/language_model/prepare-wikitext-103.sh")
  [ -s "$TEXT/wiki.test.tokens" ] || { echo "prepare-wikitext-103.sh did not produce $TEXT/wiki.test.tokens" >&2; exit 1; }
fi

stage 3 "fairseq-preprocess --only-source (word level)"
if [ -s "$BIN/dict.txt" ]; then
  echo "    up to date (remove $BIN to redo)"
else
  fairseq_tool preprocess --only-source --trainpref "$TEXT/wiki.train.tokens" \
    --validpref "$TEXT/wiki.valid.tokens" --testpref "$TEXT/wiki.test.tokens" \
    --destdir "$BIN" --workers "$(nproc)" 2>&1 | grep -E "Dictionary|tokens" | sed 's/^/    /'
fi

if [ "$DENSE" = 1 ]; then
  name=dense
  model_args=(--arch transformer_lm --criterion cross_entropy)
else
  name=moe
  model_args=(
    --arch "$ARCH" --criterion moe_cross_entropy
    --moe-expert-count "$EXPERTS" --moe-top-k "$TOPK" --moe-freq "$MOE_FREQ"
    --moe-capacity-factor "$CAPACITY_FACTOR" --moe-gate-loss-wt "$GATE_LOSS_WT"
  )
fi
# The README's flags.
readme_args=(
  --task language_modeling --share-decoder-input-output-embed --dropout 0.1
  --optimizer adam --adam-betas "(0.9, 0.98)" --weight-decay 0.01 --clip-norm 0.0
  --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --warmup-init-lr 1e-07
  --tokens-per-sample "$TOKENS_PER_SAMPLE" --sample-break-mode none
  --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ" --max-update "$MAX_UPDATE"
)
RUN=$WORK/$name
run_args=(--user-dir "$USER_DIR" --seed "$SEED" --save-dir "$RUN/ckpt" --no-epoch-checkpoints
          --save-interval-updates 5000 --keep-interval-updates 2 --log-format json --log-interval 100)
if [ "$DRY_RUN" = 1 ]; then
  # Sizes and device only: a model small enough for a CPU, and no fp16 (CPUs have no fp16 kernels).
  run_args+=(--cpu --num-workers 0 --log-interval 2 --save-interval-updates 3
    --decoder-embed-dim 32 --decoder-ffn-embed-dim 64 --decoder-layers 2 --decoder-attention-heads 2
    --decoder-input-dim 32 --decoder-output-dim 32)
else
  # fp16 flattens gradients into one buffer and would lose the expert marker: keep them per parameter.
  run_args+=(--fp16 --fp16-no-flatten-grads)
fi

stage 4 "fairseq-train $([ "$DENSE" = 1 ] && echo transformer_lm || echo "$ARCH") on $GPUS $([ "$DRY_RUN" = 1 ] && echo "CPU workers" || echo GPUs), update-freq $UPDATE_FREQ -> $RUN/ckpt"
train_workers "$GPUS" "$RUN/train.log" "$BIN" "${model_args[@]}" "${readme_args[@]}" "${run_args[@]}"
ls "$RUN/ckpt" | sed 's/^/    /'

stage 5 "fairseq-eval-lm on the test set: context window $CONTEXT_WINDOW, one process from checkpoint_best"
fairseq_tool eval-lm "$BIN" --user-dir "$USER_DIR" --path "$RUN/ckpt/checkpoint_best.pt" \
  --batch-size 2 --tokens-per-sample "$TOKENS_PER_SAMPLE" --context-window "$CONTEXT_WINDOW" \
  $([ "$DRY_RUN" = 1 ] && echo "--cpu --num-workers 0") > "$RUN/eval_test.log" 2>&1
grep -E "Evaluated|Loss .*Perplexity" "$RUN/eval_test.log" | sed -E 's/^.*(\| |eval_lm:)//' | tee "$RUN/perplexity.txt" | sed 's/^/    /'
finish
