#!/usr/bin/env bash
# A language model on real text that every machine already has: the source code of Python's
# standard library. moe_transformer_lm vs a dense transformer_lm of the same shape, both trained on
# WORKERS CPU workers (torchrun + gloo), both scored with fairseq-eval-lm (one process, from the
# MoE run's per-rank checkpoint set) on held-out files.
#
#   bash recipes/python_stdlib_lm.sh            # about 10 minutes on 2 cores
#   QUICK=1 WORK=/tmp/lm bash recipes/python_stdlib_lm.sh   # a few percent of the files, a few updates (CI)
#
# Data: the .py files under sysconfig's stdlib path, without site-packages and test suites (about
#   12 MB on CPython 3.11, of which FILES_PERCENT are used); each file goes to train, valid or test by
#   a hash of its path (recipes/stdlib_corpus.py), so the split is deterministic for a Python version.
#   Tokenization: a sentencepiece BPE model that keeps whitespace (indentation is part of Python).
# Outputs (under WORK): summary.txt (valid/test perplexity MoE vs dense, parameters),
#   plots/expert_load.png, moe/ and dense/ (train.log, ckpt/, eval_valid.log, eval_test.log).
# Perplexity is per BPE token of this tokenizer: it compares the two runs, not other tokenizers.
#
# Knobs (environment; defaults in brackets):
#   WORK [./work-dirs/python_stdlib_lm]   QUICK [0]   WORKERS [2]   THREADS [1]
#   FILES_PERCENT [60] HELDOUT_PERCENT [3]   share of the stdlib files used (600 updates see about one
#                                 epoch of 60%); share of those held out for each of valid and test
#   VOCAB [2048]                  sentencepiece BPE vocabulary
#   EXPERTS [8] TOPK [2] MOE_FREQ [2] CAPACITY_FACTOR [1.25] GATE_LOSS_WT [0.01]
#   EMBED_DIM [128] FFN_DIM [256] LAYERS [4] HEADS [4]   (FFN_DIM = expert and dense hidden size)
#   TOKENS_PER_SAMPLE [128] CONTEXT_WINDOW [64] MAX_TOKENS [2048] MAX_UPDATE [600] LR [2e-3]
#   WARMUP [100] DROPOUT [0.1] SEED [1]   DENSE [1] (0: skip the dense baseline)
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/lib/common.sh

if [ "${QUICK:-${TINY:-0}}" = 1 ]; then
  : "${FILES_PERCENT:=4}" "${HELDOUT_PERCENT:=12}" "${VOCAB:=256}" "${MAX_UPDATE:=8}" "${WARMUP:=4}"
  : "${EMBED_DIM:=32}" "${FFN_DIM:=64}" "${LAYERS:=2}" "${TOKENS_PER_SAMPLE:=64}" "${CONTEXT_WINDOW:=32}" "${MAX_TOKENS:=512}"
fi
: "${WORK:=./work-dirs/python_stdlib_lm}" "${WORKERS:=2}" "${FILES_PERCENT:=60}" "${HELDOUT_PERCENT:=3}" "${VOCAB:=2048}"
: "${EXPERTS:=8}" "${EMBED_DIM:=128}" "${FFN_DIM:=256}" "${LAYERS:=4}" "${HEADS:=4}"
: "${TOKENS_PER_SAMPLE:=128}" "${CONTEXT_WINDOW:=64}" "${MAX_TOKENS:=2048}" "${MAX_UPDATE:=600}" "${LR:=2e-3}"
: "${WARMUP:=100}" "${DROPOUT:=0.1}" "${DENSE:=1}"
shared_knob_defaults  # TOPK, MOE_FREQ, CAPACITY_FACTOR, GATE_LOSS_WT, SEED (see common.sh)

STAGES=8
echo "==> [1/$STAGES] environment"
setup_environment
DATA=$WORK/data

stage 2 "corpus: Python standard library sources ($FILES_PERCENT% of the files, $HELDOUT_PERCENT% each held out for valid and test)"
data_sig="stdlib $(python -c 'import sys; print(sys.version.split()[0])') $FILES_PERCENT $HELDOUT_PERCENT"
if needs_run "$DATA/raw/.done" "$data_sig"; then
  python recipes/stdlib_corpus.py "$DATA/raw" --percent "$FILES_PERCENT" --heldout-percent "$HELDOUT_PERCENT" | sed 's/^/    /'
  mark_done "$DATA/raw/.done" "$data_sig"
fi

stage 3 "sentencepiece BPE ($VOCAB pieces, whitespace kept), encode"
spm_sig="$data_sig vocab=$VOCAB"
if needs_run "$DATA/tok/.done" "$spm_sig"; then
  mkdir -p "$DATA/spm" "$DATA/tok"
  python recipes/spm.py train --input "$DATA/raw/train.txt" --prefix "$DATA/spm/code" --vocab-size "$VOCAB" \
    --model-type bpe --keep-whitespace --character-coverage 0.9995 --max-sentences 300000
  for split in train valid test; do
    python recipes/spm.py encode --model "$DATA/spm/code.model" < "$DATA/raw/$split.txt" > "$DATA/tok/$split.txt"
  done
  sed -n '20,23p' "$DATA/tok/train.txt" | cut -c1-150 | sed 's/^/    /'
  mark_done "$DATA/tok/.done" "$spm_sig"
fi

stage 4 "fairseq-preprocess --only-source"
if needs_run "$DATA/bin/.done" "$spm_sig"; then
  rm -rf "$DATA/bin"
  fairseq_tool preprocess --only-source --trainpref "$DATA/tok/train.txt" --validpref "$DATA/tok/valid.txt" \
    --testpref "$DATA/tok/test.txt" --destdir "$DATA/bin" --workers 2 2>&1 | grep -E "Dictionary|sents" | sed 's/^/    /'
  mark_done "$DATA/bin/.done" "$spm_sig"
fi

common_args=(
  "$DATA/bin" --task language_modeling --user-dir "$USER_DIR" --cpu --ddp-backend legacy_ddp --seed "$SEED"
  --decoder-embed-dim "$EMBED_DIM" --decoder-input-dim "$EMBED_DIM" --decoder-output-dim "$EMBED_DIM"
  --decoder-ffn-embed-dim "$FFN_DIM" --decoder-layers "$LAYERS" --decoder-attention-heads "$HEADS"
  --share-decoder-input-output-embed --dropout "$DROPOUT"
  --tokens-per-sample "$TOKENS_PER_SAMPLE" --sample-break-mode none --max-tokens "$MAX_TOKENS"
  --optimizer adam --adam-betas "(0.9, 0.98)" --weight-decay 0.01 --clip-norm 1.0
  --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --max-update "$MAX_UPDATE"
  --no-epoch-checkpoints --validate-interval-updates "$(( MAX_UPDATE >= 200 ? 200 : MAX_UPDATE ))"
  --num-workers 0 --log-format json --log-interval "$(( MAX_UPDATE >= 200 ? 25 : 2 ))"
)
moe_args=(
  --arch moe_transformer_lm --criterion moe_cross_entropy --moe-expert-count "$EXPERTS" --moe-top-k "$TOPK"
  --moe-freq "$MOE_FREQ" --moe-capacity-factor "$CAPACITY_FACTOR" --moe-gate-loss-wt "$GATE_LOSS_WT"
)
dense_args=(--arch transformer_lm --criterion cross_entropy)

train() {
  local name=$1 number=$2; shift 2
  local dir=$WORK/$name sig="$spm_sig workers=$WORKERS ${common_args[*]} $*"
  stage "$number" "$name: fairseq-train on $WORKERS CPU workers"
  if needs_run "$dir/.trained" "$sig"; then
    rm -rf "$dir"
    train_workers "$WORKERS" "$dir/train.log" "${common_args[@]}" "$@" --save-dir "$dir/ckpt"
    mark_done "$dir/.trained" "$sig"
  fi
  ls "$dir/ckpt" | sed 's/^/    /'
}

train moe 5 "${moe_args[@]}"
runs=(moe)
if [ "$DENSE" = 1 ]; then
  train dense 6 "${dense_args[@]}"
  runs+=(dense)
else
  stage 6 "dense baseline skipped (DENSE=0)"
fi

stage 7 "fairseq-eval-lm on valid and test (one process; context window $CONTEXT_WINDOW)"
for name in "${runs[@]}"; do
  for split in valid test; do
    # The rank-less name loads the MoE run's per-rank set into this one process.
    fairseq_tool eval-lm "$DATA/bin" --user-dir "$USER_DIR" --path "$WORK/$name/ckpt/checkpoint_best.pt" --cpu \
      --gen-subset "$split" --batch-size 8 --tokens-per-sample "$TOKENS_PER_SAMPLE" \
      --context-window "$CONTEXT_WINDOW" --num-workers 0 > "$WORK/$name/eval_$split.log" 2>&1
    echo "    $name $split: $(grep -oE "Loss \(base 2\): [0-9.]+, Perplexity: [0-9.]+" "$WORK/$name/eval_$split.log")"
  done
done

stage 8 "expert load plot and summary"
python recipes/plot_expert_load.py "$WORK/moe/train.log" --png "$WORK/plots/expert_load.png" \
  --title "stdlib LM: expert load during training (E=$EXPERTS, k=$TOPK, $WORKERS workers)" | sed 's/^/    /'
summary_runs=(--run MoE "$WORK/moe")
[ "$DENSE" = 1 ] && summary_runs+=(--run dense "$WORK/dense")
python recipes/summarize_lm.py "${summary_runs[@]}" --out "$WORK/summary.txt" --json-out "$WORK/summary.json" \
  --title "Python stdlib LM: moe_transformer_lm E=$EXPERTS k=$TOPK vs dense transformer_lm, $WORKERS CPU workers" \
  2>&1 | grep -v "^INFO:"
finish
