#!/usr/bin/env bash
# IWSLT'14 German->English with moe_transformer_iwslt_de_en, following fairseq's
# examples/translation/README.md step by step: prepare-iwslt14.sh, fairseq-preprocess, the
# transformer_iwslt_de_en training flags, fairseq-generate with beam 5 and --remove-bpe. The changes:
# the MoE architecture and criterion. checkpoint_best is chosen by validation BLEU, as in the README
# (EVAL_BLEU=0: by validation loss).
#
#   bash recipes/iwslt14_de_en.sh              # the real run (downloads; GPU)
#   bash recipes/iwslt14_de_en.sh --dry-run    # same pipeline and flags on a tiny local corpus, CPU, ~1 min
#
# Data: examples/translation/prepare-iwslt14.sh from the installed fairseq package: TED talks
#   (de-en.tgz from dl.fbaipublicfiles.com), Moses tokenization, lowercasing, a joint 10k-merge
#   subword-nmt BPE; about 160k training sentence pairs. It clones mosesdecoder and subword-nmt from
#   GitHub and needs git, perl and wget. --dry-run writes files of the same names and format instead.
# Resources: one GPU, like fairseq's README (CUDA_VISIBLE_DEVICES=0); a few hours to MAX_EPOCH on a
#   recent GPU. GPUS>1 makes the run expert parallel (EXPERTS must be a multiple of GPUS).
# Expected: the dense transformer_iwslt_de_en is commonly reported in the mid-30s of tokenized BLEU
#   (fairseq-generate's BLEU4 line, lowercased, --remove-bpe); fairseq's README prints no number.
#   Compare with DENSE=1 (the README's own model, same flags).
#
# Knobs (environment; defaults in brackets):
#   WORK [./work-dirs/iwslt14_de_en, --dry-run: ./work-dirs/iwslt14_de_en-dry-run]
#   GPUS [1]        GPUs to train on (torchrun workers when > 1)
#   EVAL_BLEU [1]   the README's --eval-bleu ... --best-checkpoint-metric bleu flags, on any GPUS (with
#                   experts sharded over the workers, validation generates in lock-step, and the BLEU it
#                   logs is that of one process). The README's --eval-bleu-detok moses needs
#                   `pip install sacremoses` (not in the pinned requirements); without it the recipe
#                   scores tokenized BLEU (--eval-bleu-detok space --eval-tokenized-bleu) and says so.
#                   0: checkpoint_best by validation loss, no generation during validation.
#   EXPERTS [8] TOPK [2] MOE_FREQ [2] CAPACITY_FACTOR [1.25] GATE_LOSS_WT [0.01]
#   MAX_EPOCH [60] MAX_TOKENS [4096] LR [5e-4] WARMUP [4000] SEED [1]
#   DENSE [0]       1: train fairseq's dense transformer_iwslt_de_en instead (into WORK/dense)
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/lib/common.sh
recipe_args "$@"

if [ "$DRY_RUN" = 1 ]; then
  : "${WORK:=./work-dirs/iwslt14_de_en-dry-run}" "${MAX_EPOCH:=2}" "${WARMUP:=10}" "${EXPERTS:=4}"
fi
: "${WORK:=./work-dirs/iwslt14_de_en}" "${GPUS:=1}" "${EXPERTS:=8}" "${MAX_EPOCH:=60}" "${MAX_TOKENS:=4096}"
: "${LR:=5e-4}" "${WARMUP:=4000}" "${DENSE:=0}" "${EVAL_BLEU:=1}"
shared_knob_defaults  # TOPK, MOE_FREQ, CAPACITY_FACTOR, GATE_LOSS_WT, SEED (see common.sh)

STAGES=5
echo "==> [1/$STAGES] environment$([ "$DRY_RUN" = 1 ] && echo ' (dry run: tiny local corpus, CPU, tiny model)')"
setup_environment
TEXT=$WORK/data/iwslt14.tokenized.de-en
BIN=$WORK/data-bin/iwslt14.tokenized.de-en

stage 2 "data: $([ "$DRY_RUN" = 1 ] && echo "tiny stand-in corpus" || echo "fairseq's prepare-iwslt14.sh") -> $TEXT"
if [ -s "$TEXT/test.en" ]; then
  echo "    up to date (remove $TEXT to redo)"
elif [ "$DRY_RUN" = 1 ]; then
  python recipes/tiny_corpus.py translation "$TEXT" --src de --tgt en --splits train,valid,test --sizes 600 40 40
else
  examples=$(fairseq_examples)
  # The script works in its current directory: clones, downloads and writes iwslt14.tokenized.de-en/ there.
  mkdir -p "$WORK/data"
  (cd "$WORK/data" && bash "$examples/translation/prepare-iwslt14.sh")
  # It exits 0 on failed downloads; check what it was meant to leave.
  [ -s "$TEXT/test.en" ] || { echo "prepare-iwslt14.sh did not produce $TEXT/test.en (see its output above)" >&2; exit 1; }
fi

stage 3 "fairseq-preprocess"
if [ -s "$BIN/dict.en.txt" ]; then
  echo "    up to date (remove $BIN to redo)"
else
  fairseq_tool preprocess --source-lang de --target-lang en \
    --trainpref "$TEXT/train" --validpref "$TEXT/valid" --testpref "$TEXT/test" \
    --destdir "$BIN" --workers "$(nproc)" 2>&1 | grep -E "Dictionary|sents" | sed 's/^/    /'
fi

# The README's training flags, verbatim apart from the MoE architecture and criterion.
readme_args=(
  --share-decoder-input-output-embed
  --optimizer adam --adam-betas "(0.9, 0.98)" --clip-norm 0.0
  --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP"
  --dropout 0.3 --weight-decay 0.0001
  --label-smoothing 0.1 --max-tokens "$MAX_TOKENS"
)
bleu_args=()
if [ "$EVAL_BLEU" = 1 ]; then
  detok=(--eval-bleu-detok moses)
  if ! python -c "import sacremoses" 2>/dev/null; then
    echo "sacremoses is not installed: validation scores tokenized BLEU (pip install sacremoses for the README's detokenized BLEU)" >&2
    detok=(--eval-bleu-detok space --eval-tokenized-bleu)
  fi
  bleu_args=(
    --eval-bleu --eval-bleu-args '{"beam": 5, "max_len_a": 1.2, "max_len_b": 10}'
    "${detok[@]}" --eval-bleu-remove-bpe --eval-bleu-print-samples
    --best-checkpoint-metric bleu --maximize-best-checkpoint-metric
  )
fi
if [ "$DENSE" = 1 ]; then
  name=dense
  model_args=(--arch transformer_iwslt_de_en --criterion label_smoothed_cross_entropy)
else
  name=moe
  model_args=(
    --arch moe_transformer_iwslt_de_en --criterion moe_label_smoothed_cross_entropy
    --moe-expert-count "$EXPERTS" --moe-top-k "$TOPK" --moe-freq "$MOE_FREQ"
    --moe-capacity-factor "$CAPACITY_FACTOR" --moe-gate-loss-wt "$GATE_LOSS_WT"
  )
fi
run_args=(--user-dir "$USER_DIR" --seed "$SEED" --max-epoch "$MAX_EPOCH" --no-epoch-checkpoints --log-format json --log-interval 100)
if [ "$DRY_RUN" = 1 ]; then
  # Sizes only: the same flags on a model small enough for a CPU.
  run_args+=(--cpu --num-workers 0 --log-interval 5
    --encoder-embed-dim 32 --encoder-ffn-embed-dim 64 --encoder-layers 2 --encoder-attention-heads 2
    --decoder-embed-dim 32 --decoder-ffn-embed-dim 64 --decoder-layers 2 --decoder-attention-heads 2)
fi

RUN=$WORK/$name
stage 4 "fairseq-train ${model_args[1]} on $([ "$DRY_RUN" = 1 ] && echo "1 CPU process" || echo "$GPUS GPU(s)") -> $RUN/ckpt"
# One GPU is one process, as in the README; several GPUs are torchrun workers (see common.sh).
train_workers "$GPUS" "$RUN/train.log" "$BIN" "${model_args[@]}" "${readme_args[@]}" "${bleu_args[@]}" \
  "${run_args[@]}" --save-dir "$RUN/ckpt"
ls "$RUN/ckpt" | sed 's/^/    /'

stage 5 "fairseq-generate: beam 5, --remove-bpe, one process from checkpoint_best"
fairseq_tool generate "$BIN" --user-dir "$USER_DIR" --path "$RUN/ckpt/checkpoint_best.pt" \
  --batch-size 128 --beam 5 --remove-bpe $([ "$DRY_RUN" = 1 ] && echo --cpu) \
  > "$RUN/generate.out" 2> "$RUN/generate.log"
grep -E "^(S|T|H)-1\s" "$RUN/generate.out" | sed 's/^/    /'
tail -n 1 "$RUN/generate.out" | tee "$RUN/bleu.txt" | sed 's/^/    /'
finish
