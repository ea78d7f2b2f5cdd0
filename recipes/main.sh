#!/usr/bin/env bash
# The main job: a Mixture-of-Experts translation model trained end to end on this machine's CPUs.
#
#   bash recipes/main.sh                    # about 11 minutes on 2 cores (+ about 2 min for the venv on first use)
#   EXPERTS=4 MAX_UPDATE=400 bash recipes/main.sh
#   TINY=1 WORK=/tmp/w bash recipes/main.sh # the same pipeline in about a minute (what the tests run)
#
# Pipeline: an invented multi-domain corpus (eight source dialects that share their word forms but
# give them different meanings, word orders and function words, translated into one target language;
# recipes/make_dialects.py; each source sentence starts with its dialect's <2name> token), a
# sentencepiece BPE model per side, fairseq-preprocess, `moe_transformer` trained on WORKERS CPU
# workers (torchrun + gloo, expert parallel, per-rank checkpoint sets), fairseq-generate in ONE
# process from the set, sacrebleu; the same for two dense `transformer` baselines of the same shape:
# `dense` (FFN hidden size = one expert's, FFN_DIM) and `dense_matched` (FFN hidden size = TOPK x
# FFN_DIM, so a token meets as many FFN weights and FLOPs as in the MoE, which applies TOPK experts);
# then plots of the expert load over training and of which experts each dialect's tokens use, and a
# summary with BLEU, active parameters and FLOPs per token of all three.
#
# Outputs (under WORK):
#   summary.txt                BLEU MoE vs both dense baselines (overall and per dialect),
#                              parameters (total, active per token), FLOPs per token, balance
#   summary.json               the same, machine-readable
#   plots/expert_load.png      every MoE layer's per-expert share of tokens over training
#   plots/routing_by_domain.png  dialect x expert routing matrix per MoE layer (test set)
#   moe/ dense/ dense_matched/ upcycled/ train.log, ckpt/ (MoE: checkpoint_best-rank-R-of-W.pt + .set.json),
#                              generate.out (fairseq-generate), hyp.txt, bleu.json
#   data/                      raw/ (text + .domain labels), spm/, tok/, bin/ (fairseq-preprocess)
# Re-running skips every step whose knobs did not change; remove WORK (or a subdirectory) to redo it.
#
# Knobs (environment variables; defaults in brackets):
#   WORK [./work-dirs/main]   output directory
#   TINY [0]                  1: tiny corpus and a few updates, to check the pipeline (defaults below change)
#   WORKERS [2]               CPU worker processes for training (EXPERTS must be a multiple)
#   MOE_USER_DIR []           another checkout's plugin folder to run with (benchmarks/main_job_wall.py)
#   THREADS [1]               intra-op threads per worker
#   EXPERTS [8]  TOPK [2]     experts per MoE layer and experts per token
#   MOE_FREQ [2]              every MOE_FREQ-th layer is MoE (2 layers per side: layer 1 of each)
#   CAPACITY_FACTOR [1.25]    training capacity (0 = dropless); inference is always dropless
#   GATE_LOSS_WT [0.01]       balance loss weight
#   EMBED_DIM [64] FFN_DIM [128] LAYERS [2] HEADS [4]   model shape (FFN_DIM = expert and `dense` hidden
#                             size; `dense_matched` has TOPK x FFN_DIM)
#   MAX_UPDATE [600] MAX_TOKENS [2048] LR [3e-3] WARMUP [100] DROPOUT [0.1] SEED [1]
#   DIALECTS [8]              source dialects (domains), 1..8
#   TRAIN_PER_DOMAIN [1000] VALID_PER_DOMAIN [50] TEST_PER_DOMAIN [100]   sentence pairs per dialect
#   SRC_VOCAB [320] TGT_VOCAB [320]   sentencepiece BPE vocabulary sizes
#   DOMAIN_TAG [1]            prepend a <2dialect> token to every source sentence (0: the model must infer
#                             the dialect from word order and particles alone)
#   BEAM [5]                  beam size for fairseq-generate
#   SYNONYMS [1]              source forms per target word per dialect: the corpus's difficulty knob
#   DENSE [1]                 0: skip the dense baseline of the expert's hidden size
#   DENSE_MATCHED [1]         0: skip the compute-matched dense baseline (hidden size TOPK x FFN_DIM)
#   SHARED_EXPERTS [0]        shared experts per MoE layer (DeepSeek-MoE), always active beside the TOPK routed
#   BALANCE [loss]            bias: add DeepSeek-V3's loss-free bias balancing (rate BIAS_UPDATE_RATE [0.001]);
#                             the balance loss stays unless GATE_LOSS_WT=0
#   ROUTER [top]              top, cosine or sigmoid (DeepSeek-V3's gating; needs TOPK >= 2)
#                             With SHARED_EXPERTS or BALANCE=bias, moe_base (the same MoE without them) is
#                             trained too and the summary compares the two.
#   UPCYCLE [0]               1: sparse upcycling as well: the dense model at update UPCYCLE_AT (upcycle_base/)
#                             becomes an MoE (every expert a copy of the dense FFN; --moe-upcycle-from) that
#                             trains on to MAX_UPDATE updates in all (`upcycled/`), so the summary compares
#                             dense, upcycled and from-scratch MoE at equal updates (needs DENSE=1)
#   UPCYCLE_AT [MAX_UPDATE/2] the dense update the upcycled MoE starts from
#   UPCYCLE_ROUTER_STD [0.01] std of the upcycled routers' initial weights (0: zero, every token ties)
#   MOE_FLAGS []              more fairseq-train flags for the MoE run (e.g. "--update-freq 4 --moe-balance-scope
#                             global-batch"; recipes/balance_scope_freeze.sh compares runs with them)
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/lib/common.sh

if [ "${TINY:-0}" = 1 ]; then
  : "${TRAIN_PER_DOMAIN:=40}" "${VALID_PER_DOMAIN:=4}" "${TEST_PER_DOMAIN:=4}"
  : "${MAX_UPDATE:=12}" "${MAX_TOKENS:=600}" "${WARMUP:=4}" "${SRC_VOCAB:=200}" "${TGT_VOCAB:=100}" "${BEAM:=2}"
fi
: "${WORK:=./work-dirs/main}"
: "${WORKERS:=2}" "${EXPERTS:=8}" "${EMBED_DIM:=64}" "${FFN_DIM:=128}" "${LAYERS:=2}" "${HEADS:=4}"
: "${MAX_UPDATE:=600}" "${MAX_TOKENS:=2048}" "${LR:=3e-3}" "${WARMUP:=100}" "${DROPOUT:=0.1}"
: "${DIALECTS:=8}" "${TRAIN_PER_DOMAIN:=1000}" "${VALID_PER_DOMAIN:=50}" "${TEST_PER_DOMAIN:=100}"
: "${SRC_VOCAB:=320}" "${TGT_VOCAB:=320}" "${DOMAIN_TAG:=1}" "${BEAM:=5}" "${DENSE:=1}"
: "${SYNONYMS:=1}" "${DENSE_MATCHED:=1}" "${UPCYCLE:=0}" "${UPCYCLE_AT:=$(( MAX_UPDATE / 2 ))}" "${UPCYCLE_ROUTER_STD:=0.01}"
if [ "$UPCYCLE" = 1 ] && { [ "$DENSE" != 1 ] || [ "$UPCYCLE_AT" -lt 1 ] || [ "$UPCYCLE_AT" -ge "$MAX_UPDATE" ]; }; then
  echo "UPCYCLE=1 upcycles the dense run at update UPCYCLE_AT: keep DENSE=1 and 1 <= UPCYCLE_AT < MAX_UPDATE" \
    "(got DENSE=$DENSE UPCYCLE_AT=$UPCYCLE_AT MAX_UPDATE=$MAX_UPDATE)" >&2
  exit 2
fi
shared_knob_defaults  # TOPK, MOE_FREQ, CAPACITY_FACTOR, GATE_LOSS_WT, SEED (see common.sh)
: "${SHARED_EXPERTS:=0}" "${BALANCE:=loss}" "${BIAS_UPDATE_RATE:=0.001}" "${ROUTER:=top}"
case "$BALANCE" in loss|bias) ;; *) echo "error: BALANCE=$BALANCE: use BALANCE=loss or BALANCE=bias" >&2; exit 2 ;; esac

STAGES=11
echo "==> [1/$STAGES] environment"
setup_environment
DATA=$WORK/data
echo "    WORK=$WORK  workers=$WORKERS  experts=$EXPERTS  k=$TOPK  max_update=$MAX_UPDATE  seed=$SEED"

stage 2 "corpus: $DIALECTS dialects -> 1 target language ($TRAIN_PER_DOMAIN/$VALID_PER_DOMAIN/$TEST_PER_DOMAIN pairs per dialect)"
data_sig="dialects=$DIALECTS $TRAIN_PER_DOMAIN $VALID_PER_DOMAIN $TEST_PER_DOMAIN synonyms=$SYNONYMS seed=$SEED"
if needs_run "$DATA/raw/.done" "$data_sig"; then
  python recipes/make_dialects.py "$DATA/raw" --dialects "$DIALECTS" --train "$TRAIN_PER_DOMAIN" \
    --valid "$VALID_PER_DOMAIN" --test "$TEST_PER_DOMAIN" --synonyms "$SYNONYMS" --seed "$SEED"
  mark_done "$DATA/raw/.done" "$data_sig"
fi

stage 3 "sentencepiece BPE (source $SRC_VOCAB, target $TGT_VOCAB pieces), encode"
spm_sig="$data_sig spm $SRC_VOCAB $TGT_VOCAB tag=$DOMAIN_TAG"
if needs_run "$DATA/tok/.done" "$spm_sig"; then
  mkdir -p "$DATA/spm" "$DATA/tok"
  # One model per side: the dialects and the target share no words, so a joint vocabulary would
  # only spend pieces on the other side's words.
  python recipes/spm.py train --input "$DATA/raw/train.src" --prefix "$DATA/spm/src" --vocab-size "$SRC_VOCAB" --model-type bpe
  python recipes/spm.py train --input "$DATA/raw/train.tgt" --prefix "$DATA/spm/tgt" --vocab-size "$TGT_VOCAB" --model-type bpe
  for split in train valid test; do
    for side in src tgt; do
      python recipes/spm.py encode --model "$DATA/spm/$side.model" < "$DATA/raw/$split.$side" > "$DATA/tok/$split.$side"
    done
    if [ "$DOMAIN_TAG" = 1 ]; then
      # The tag is a token of its own, added after sentencepiece so that it is never split.
      sed 's/.*/<2&>/' "$DATA/raw/$split.domain" | paste -d ' ' - "$DATA/tok/$split.src" > "$DATA/tok/$split.src.tagged"
      mv "$DATA/tok/$split.src.tagged" "$DATA/tok/$split.src"
    fi
  done
  head -n 2 "$DATA/tok/train.src" "$DATA/tok/train.tgt"
  mark_done "$DATA/tok/.done" "$spm_sig"
fi

stage 4 "fairseq-preprocess"
if needs_run "$DATA/bin/.done" "$spm_sig"; then
  rm -rf "$DATA/bin"
  fairseq_tool preprocess --source-lang src --target-lang tgt \
    --trainpref "$DATA/tok/train" --validpref "$DATA/tok/valid" --testpref "$DATA/tok/test" \
    --destdir "$DATA/bin" --workers 2 2>&1 | tee "$WORK/data/preprocess.log" | grep -E "Dictionary|sents"
  mark_done "$DATA/bin/.done" "$spm_sig"
fi

# Flags all models share: same shape (but FFN hidden size), data, optimiser, schedule, batch and seed.
common_args=(
  "$DATA/bin" --user-dir "$USER_DIR" --cpu --ddp-backend legacy_ddp --seed "$SEED"
  --encoder-embed-dim "$EMBED_DIM" --encoder-layers "$LAYERS"
  --encoder-attention-heads "$HEADS" --decoder-embed-dim "$EMBED_DIM"
  --decoder-layers "$LAYERS" --decoder-attention-heads "$HEADS" --dropout "$DROPOUT"
  --label-smoothing 0.1 --optimizer adam --adam-betas "(0.9, 0.98)" --lr "$LR"
  --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --clip-norm 1.0
  --max-tokens "$MAX_TOKENS" --max-update "$MAX_UPDATE" --no-epoch-checkpoints --num-workers 0
  --log-format json --log-interval "$(( MAX_UPDATE >= 200 ? 25 : 2 ))"
)
ffn_args() { echo --encoder-ffn-embed-dim "$1" --decoder-ffn-embed-dim "$1"; }
moe_args=(
  $(ffn_args "$FFN_DIM") --arch moe_transformer --moe-expert-count "$EXPERTS" --moe-top-k "$TOPK" --moe-freq "$MOE_FREQ"
  --moe-capacity-factor "$CAPACITY_FACTOR" --moe-eval-capacity-factor 0
  --criterion moe_label_smoothed_cross_entropy --moe-gate-loss-wt "$GATE_LOSS_WT" --moe-router "$ROUTER"
  ${MOE_FLAGS:-}
)
# Routing extensions (issue 20): the MoE run gets them; moe_base, the same MoE without them, shows their effect.
extension_args=()
[ "$SHARED_EXPERTS" != 0 ] && extension_args+=(--moe-shared-expert-count "$SHARED_EXPERTS")
[ "$BALANCE" = bias ] && extension_args+=(--moe-balance bias --moe-bias-update-rate "$BIAS_UPDATE_RATE")
dense_args=(--arch transformer --criterion label_smoothed_cross_entropy)
# The MoE applies TOPK experts of hidden size FFN_DIM to each token, so a dense FFN of TOPK x FFN_DIM
# costs the same per token in the MoE layers. (In the layers the MoE keeps dense, MOE_FREQ > 1, this
# baseline spends TOPK x as much as the MoE does: it errs on the dense side; MOE_FREQ=1 matches exactly.)
matched_ffn_dim=$(( TOPK * FFN_DIM ))
# The flags every model of the job shares (data first), and the compute-matched dense model's own, one per line:
# the recipes that train more models of the job read them (recipes/distillation.sh, recipes/heal_pruned.py).
mkdir -p "$WORK"
printf '%s\n' "${common_args[@]}" > "$WORK/common_args.txt"
printf '%s\n' $(ffn_args "$matched_ffn_dim") "${dense_args[@]}" > "$WORK/dense_matched_args.txt"

# train_and_evaluate NAME STAGE ARGS...: train on WORKERS workers, then generate in one process.
train_and_evaluate() {
  local name=$1 number=$2; shift 2
  local dir=$WORK/$name
  local sig="$spm_sig workers=$WORKERS ${common_args[*]} $*"
  stage "$number" "$name: fairseq-train on $WORKERS CPU workers, then fairseq-generate (1 process) + sacrebleu"
  if needs_run "$dir/.trained" "$sig"; then
    rm -rf "$dir"
    train_workers "$WORKERS" "$dir/train.log" "${common_args[@]}" "$@" --save-dir "$dir/ckpt"
    mark_done "$dir/.trained" "$sig"
  fi
  ls "$dir/ckpt" | sed 's/^/    /'
  # The rank-less name loads the whole per-rank set into this one process: no conversion step.
  if needs_run "$dir/.generated" "$sig beam=$BEAM"; then
    fairseq_tool generate "$DATA/bin" --user-dir "$USER_DIR" --path "$dir/ckpt/checkpoint_best.pt" --cpu \
      --gen-subset test --beam "$BEAM" --batch-size 128 --remove-bpe sentencepiece --num-workers 0 \
      > "$dir/generate.out" 2> "$dir/generate.log"
    mark_done "$dir/.generated" "$sig beam=$BEAM"
  fi
  grep -E "^(S|T|H)-(0|1|2|3)\s" "$dir/generate.out" | head -n 12 | sed 's/^/    /'
  tail -n 1 "$dir/generate.out" | sed 's/^/    fairseq-generate: /'
  python recipes/score_translations.py "$dir/generate.out" --ref "$DATA/raw/test.tgt" \
    --domains "$DATA/raw/test.domain" --hyp-out "$dir/hyp.txt" --json-out "$dir/bleu.json" --name "$name"
}

train_and_evaluate moe 5 "${moe_args[@]}" "${extension_args[@]}"
[ "${#extension_args[@]}" = 0 ] || train_and_evaluate moe_base 5 "${moe_args[@]}"
if [ "$DENSE" = 1 ]; then
  train_and_evaluate dense 6 $(ffn_args "$FFN_DIM") "${dense_args[@]}"
else
  stage 6 "dense baseline skipped (DENSE=0)"
fi
if [ "$DENSE_MATCHED" = 1 ]; then
  train_and_evaluate dense_matched 7 $(ffn_args "$matched_ffn_dim") "${dense_args[@]}"
else
  stage 7 "compute-matched dense baseline skipped (DENSE_MATCHED=0)"
fi

if [ "$UPCYCLE" = 1 ]; then
  # The dense run's state at update UPCYCLE_AT: the same run stopped there (same flags, seed and batches;
  # fairseq keeps no checkpoint of an update that ends an epoch under --no-epoch-checkpoints).
  base=$WORK/upcycle_base
  base_sig="$spm_sig workers=$WORKERS ${common_args[*]} $(ffn_args "$FFN_DIM") ${dense_args[*]} at=$UPCYCLE_AT"
  echo "    first the dense model up to update $UPCYCLE_AT, to upcycle ($base/train.log)"
  if needs_run "$base/.trained" "$base_sig"; then
    rm -rf "$base"
    train_workers "$WORKERS" "$base/train.log" "${common_args[@]}" $(ffn_args "$FFN_DIM") "${dense_args[@]}" \
      --max-update "$UPCYCLE_AT" --save-dir "$base/ckpt" > /dev/null
    mark_done "$base/.trained" "$base_sig"
  fi
  # Upcycled: the MoE's flags, gates renormalised over the top-k (so it starts as the dense model), and
  # the updates left to MAX_UPDATE; fresh optimizer.
  train_and_evaluate upcycled 8 "${moe_args[@]}" --moe-normalize-gate --moe-upcycle-from "$base/ckpt/checkpoint_last.pt" \
    --moe-upcycle-router-std "$UPCYCLE_ROUTER_STD" --max-update $(( MAX_UPDATE - UPCYCLE_AT ))
else
  stage 8 "upcycled MoE skipped (UPCYCLE=0)"
fi

stage 9 "routing by domain: which experts each dialect's tokens use (test set, merged set in one process)"
routing_sig="$(cat "$WORK/moe/.trained") E=$EXPERTS k=$TOPK"
if needs_run "$WORK/plots/.routing" "$routing_sig"; then
  python recipes/routing_by_domain.py --data "$DATA/bin" --path "$WORK/moe/ckpt/checkpoint_best.pt" \
    --domains "$DATA/raw/test.domain" --subset test --png "$WORK/plots/routing_by_domain.png" \
    --json-out "$WORK/routing.json" --title "routing by dialect (E=$EXPERTS, k=$TOPK, test set)" 2>&1 \
    | grep -v "^INFO:"
  mark_done "$WORK/plots/.routing" "$routing_sig"
fi

stage 10 "plot expert load over training"
if needs_run "$WORK/plots/.expert_load" "$routing_sig"; then
  python recipes/plot_expert_load.py "$WORK/moe/train.log" --png "$WORK/plots/expert_load.png" \
    --title "expert load during training (E=$EXPERTS, k=$TOPK, capacity factor $CAPACITY_FACTOR, $WORKERS workers)"
  mark_done "$WORK/plots/.expert_load" "$routing_sig"
fi

stage 11 "summary"
runs=(--run MoE "$WORK/moe")
[ "${#extension_args[@]}" = 0 ] || runs+=(--run moe_base "$WORK/moe_base")
[ "$DENSE" = 1 ] && runs+=(--run dense "$WORK/dense")
[ "$DENSE_MATCHED" = 1 ] && runs+=(--run dense_matched "$WORK/dense_matched")
[ "$UPCYCLE" = 1 ] && runs+=(--run upcycled "$WORK/upcycled" --upcycled upcycled "$UPCYCLE_AT")
python recipes/summarize_translation.py "${runs[@]}" --routing "$WORK/routing.json" \
  --title "main job: $DIALECTS dialects -> 1 target; moe_transformer E=$EXPERTS k=$TOPK vs dense transformer (FFN $FFN_DIM and $matched_ffn_dim); $WORKERS CPU workers" \
  --out "$WORK/summary.txt" --json-out "$WORK/summary.json" 2>&1 | grep -v "^INFO:"
echo
echo "    plots: $WORK/plots/expert_load.png  $WORK/plots/routing_by_domain.png"
echo "    summary: $WORK/summary.txt"
finish
