#!/usr/bin/env bash
# WMT'16 English->German with moe_transformer_wmt_en_de on several GPU nodes, following fairseq's
# examples/scaling_nmt/README.md: Google's preprocessed bpe32k data, a joined 32k dictionary,
# shared embeddings, Adam with inverse-sqrt warmup, fp16, large batches through --update-freq,
# beam 4 with length penalty 0.6, compound-split BLEU on newstest2014. The README trains the big
# model; this recipe trains the base shape with MoE feed-forward blocks (every other layer).
#
#   bash recipes/wmt16_en_de.sh --dry-run      # same pipeline and flags on a tiny local corpus, 2 CPU workers
#   bash recipes/wmt16_en_de.sh                # one node, all GPUS_PER_NODE GPUs (torchrun)
#   # several nodes with torchrun: prepare once, then start the same command on every node
#   PREPARE_ONLY=1 bash recipes/wmt16_en_de.sh
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0> bash recipes/wmt16_en_de.sh
#   # several nodes with SLURM: the batch script runs once (data), srun starts one task per GPU
#   sbatch --nodes 4 --ntasks-per-node 8 --gpus-per-node 8 --cpus-per-task 10 recipes/wmt16_en_de.sh  # from the repo root
#
# Data: wmt16_en_de.tar.gz, WMT'16 En-De as preprocessed by Google (tokenized, 32k BPE; about 4.5M
#   sentence pairs), from the Google Drive link in fairseq's scaling_nmt README. Download it yourself
#   (Drive asks for confirmation) and point WMT16_TARBALL at it. Validation newstest2013, test
#   newstest2014.
# Resources: GPUs with fp16 (Volta or newer); the README's batch is 128 GPUs' worth of 3584 tokens,
#   reached through --update-freq on fewer GPUs (an update is 128 micro-batches spread over the GPUs):
#   expect on the order of a day for MAX_UPDATE on one 8-GPU node, proportionally less on more nodes.
#   Disk: a few GB for the binarized data; each checkpoint set holds all experts.
# Expected: for reference, the dense Transformer base reaches about 27 BLEU on newstest2014 in
#   Vaswani et al. (2017) and big about 28-29 (fairseq's README prints 29.29 compound-split for its big
#   model); the MoE model should be compared with a dense run of the same recipe (DENSE=1).
# Not automated: the README's checkpoint averaging (scripts/average_checkpoints.py reads single
#   files: merge each set first with `python -m fairseq_moe_ext.checkpoint merge`), and sacrebleu on
#   detokenized output (the README's scripts/sacrebleu.sh).
#
# Knobs (environment; defaults in brackets):
#   WORK [./work-dirs/wmt16_en_de, --dry-run: ./work-dirs/wmt16_en_de-dry-run]
#   WMT16_TARBALL [$WORK/wmt16_en_de.tar.gz]
#   LAUNCHER [slurm inside an sbatch job with several tasks, else torchrun]
#   GPUS_PER_NODE [all visible; --dry-run: 2 CPU workers]   NNODES [1; slurm: SLURM_NNODES]   NODE_RANK [0]
#   MASTER_ADDR [localhost] MASTER_PORT [29500]   (multi-node torchrun; slurm uses the port only)
#   PREPARE_ONLY [0]   1: stop after fairseq-preprocess
#   EXPERTS [16] TOPK [2] MOE_FREQ [2] CAPACITY_FACTOR [1.25] GATE_LOSS_WT [0.01]
#   EXPERT_PARALLEL [gcd(EXPERTS, GPUS_PER_NODE)]   --moe-expert-parallel-size: each group of this many
#     consecutive GPUs holds every expert once (EXPERTS / EXPERT_PARALLEL per GPU) and the groups are
#     replicas; it must divide EXPERTS and the total GPU count, and the default keeps a group in a node
#   MAX_UPDATE [50000, a starting point, not a tuned value] MAX_TOKENS [3584] LR [0.001] WARMUP [4000]
#   DROPOUT [0.1, base size; the README's 0.3 is for big]   UPDATE_FREQ [128 / total GPUs, at least 1]
#   DENSE [0]   1: the dense transformer_wmt_en_de with the same flags (into WORK/dense)
#   SEED [1]
set -euo pipefail
if [ -f "$(dirname "$0")/lib/venv.sh" ]; then
  cd "$(dirname "$0")/.."
else  # sbatch runs a copy of this file from its spool directory
  cd "${SLURM_SUBMIT_DIR:?cannot find the repository: submit from its root}"
fi
source recipes/lib/common.sh
recipe_args "$@"

if [ "$DRY_RUN" = 1 ]; then
  : "${WORK:=./work-dirs/wmt16_en_de-dry-run}" "${GPUS_PER_NODE:=2}" "${MAX_UPDATE:=6}" "${WARMUP:=4}"
  : "${EXPERTS:=4}" "${MAX_TOKENS:=600}" "${UPDATE_FREQ:=1}" "${LAUNCHER:=torchrun}"
fi
: "${WORK:=./work-dirs/wmt16_en_de}" "${NNODES:=1}" "${NODE_RANK:=0}" "${MASTER_ADDR:=localhost}" "${MASTER_PORT:=29500}"
: "${EXPERTS:=16}" "${MAX_UPDATE:=50000}" "${MAX_TOKENS:=3584}" "${LR:=0.001}" "${WARMUP:=4000}" "${DROPOUT:=0.1}"
: "${DENSE:=0}" "${PREPARE_ONLY:=0}"
shared_knob_defaults  # TOPK, MOE_FREQ, CAPACITY_FACTOR, GATE_LOSS_WT, SEED (see common.sh)

STAGES=5
echo "==> [1/$STAGES] environment$([ "$DRY_RUN" = 1 ] && echo ' (dry run: tiny local corpus, 2 CPU workers, tiny model)')"
setup_environment
: "${WMT16_TARBALL:=$WORK/wmt16_en_de.tar.gz}"
: "${LAUNCHER:=$([ -n "${SLURM_JOB_ID:-}" ] && [ "${SLURM_NTASKS:-1}" -gt 1 ] && echo slurm || echo torchrun)}"
[ "$LAUNCHER" = slurm ] && NNODES=$SLURM_NNODES
: "${GPUS_PER_NODE:=$(python -c 'import torch; print(torch.cuda.device_count())')}"
WORLD=$((NNODES * GPUS_PER_NODE))
# Expert all-to-alls stay within a node (fast links); nodes hold replicas of the experts.
: "${EXPERT_PARALLEL:=$(python -c "import math; print(math.gcd($EXPERTS, $GPUS_PER_NODE))")}"
: "${UPDATE_FREQ:=$((WORLD >= 128 ? 1 : 128 / WORLD))}"
TEXT=$WORK/data/wmt16_en_de_bpe32k
BIN=$WORK/data-bin/wmt16_en_de_bpe32k

stage 2 "data: $([ "$DRY_RUN" = 1 ] && echo "tiny stand-in corpus" || echo "$WMT16_TARBALL") -> $TEXT"
if [ -s "$TEXT/newstest2014.tok.bpe.32000.de" ]; then
  echo "    up to date (remove $TEXT to redo)"
elif [ "$DRY_RUN" = 1 ]; then
  python recipes/tiny_corpus.py translation "$TEXT" --src en --tgt de --sizes 800 40 40 \
    --splits train.tok.clean.bpe.32000,newstest2013.tok.bpe.32000,newstest2014.tok.bpe.32000
else
  if [ ! -s "$WMT16_TARBALL" ]; then
    echo "missing $WMT16_TARBALL: download wmt16_en_de.tar.gz from the Google Drive link in fairseq's" >&2
    echo "examples/scaling_nmt/README.md and set WMT16_TARBALL to its path" >&2
    exit 1
  fi
  mkdir -p "$TEXT"
  tar -xzvf "$WMT16_TARBALL" -C "$TEXT" | sed 's/^/    /'
fi

stage 3 "fairseq-preprocess (joined dictionary, 32768 types)"
if [ -s "$BIN/dict.de.txt" ]; then
  echo "    up to date (remove $BIN to redo)"
else
  fairseq_tool preprocess --source-lang en --target-lang de \
    --trainpref "$TEXT/train.tok.clean.bpe.32000" --validpref "$TEXT/newstest2013.tok.bpe.32000" \
    --testpref "$TEXT/newstest2014.tok.bpe.32000" --destdir "$BIN" \
    --nwordssrc 32768 --nwordstgt 32768 --joined-dictionary --workers "$(nproc)" 2>&1 \
    | grep -E "Dictionary|sents" | sed 's/^/    /'
fi
[ "$PREPARE_ONLY" = 1 ] && { finish; exit 0; }

if [ "$DENSE" = 1 ]; then
  name=dense
  model_args=(--arch transformer_wmt_en_de --criterion label_smoothed_cross_entropy)
else
  name=moe
  model_args=(
    --arch moe_transformer_wmt_en_de --criterion moe_label_smoothed_cross_entropy
    --moe-expert-count "$EXPERTS" --moe-expert-parallel-size "$EXPERT_PARALLEL" --moe-top-k "$TOPK" --moe-freq "$MOE_FREQ"
    --moe-capacity-factor "$CAPACITY_FACTOR" --moe-gate-loss-wt "$GATE_LOSS_WT"
  )
fi
# The scaling_nmt README's flags (base-size dropout, its large-batch learning rate).
readme_args=(
  --share-all-embeddings
  --optimizer adam --adam-betas "(0.9, 0.98)" --clip-norm 0.0
  --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" --warmup-init-lr 1e-07
  --dropout "$DROPOUT" --weight-decay 0.0
  --label-smoothing 0.1 --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ"
)
RUN=$WORK/$name
run_args=(--user-dir "$USER_DIR" --seed "$SEED" --max-update "$MAX_UPDATE" --save-dir "$RUN/ckpt"
          --save-interval-updates 2000 --keep-interval-updates 5 --log-format json --log-interval 100)
if [ "$DRY_RUN" = 1 ]; then
  # Sizes and device only: a model small enough for a CPU, and no fp16 (CPUs have no fp16 kernels).
  run_args+=(--cpu --num-workers 0 --log-interval 2 --save-interval-updates 3
    --encoder-embed-dim 32 --encoder-ffn-embed-dim 64 --encoder-layers 2 --encoder-attention-heads 2
    --decoder-embed-dim 32 --decoder-ffn-embed-dim 64 --decoder-layers 2 --decoder-attention-heads 2)
else
  # fp16 flattens gradients into one buffer and would lose the expert marker: keep them per parameter.
  run_args+=(--fp16 --fp16-no-flatten-grads)
fi

stage 4 "fairseq-train ${model_args[1]} on $NNODES node(s) x $GPUS_PER_NODE $([ "$DRY_RUN" = 1 ] && echo "CPU workers" || echo GPUs), update-freq $UPDATE_FREQ -> $RUN/ckpt"
mkdir -p "$RUN"
if [ "$LAUNCHER" = slurm ]; then
  # The batch script (this file, run once by sbatch) prepared the data; srun starts one task per
  # GPU and fairseq reads the SLURM environment: rank = SLURM_PROCID, rendezvous on the first node.
  # --heartbeat-timeout: a task whose step hangs exits instead of holding every node (see README).
  srun --kill-on-bad-exit=1 "$FAIRSEQ_BIN/fairseq-train" "$BIN" "${model_args[@]}" "${readme_args[@]}" \
    "${run_args[@]}" --distributed-world-size "$WORLD" --distributed-port "$MASTER_PORT" \
    --heartbeat-timeout 1800 2>&1 | tee "$RUN/train.log"
elif [ "$NNODES" -gt 1 ]; then
  python -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$FAIRSEQ_BIN/fairseq-train" "$BIN" \
    "${model_args[@]}" "${readme_args[@]}" "${run_args[@]}" --distributed-world-size "$WORLD" 2>&1 | tee "$RUN/train.log"
  [ "$NODE_RANK" = 0 ] || { finish; exit 0; }  # generation runs once, on node 0
else
  train_workers "$GPUS_PER_NODE" "$RUN/train.log" "$BIN" "${model_args[@]}" "${readme_args[@]}" "${run_args[@]}"
fi
ls "$RUN/ckpt" | sed 's/^/    /'

stage 5 "fairseq-generate: beam 4, lenpen 0.6, --remove-bpe; compound-split BLEU (newstest2014)"
fairseq_tool generate "$BIN" --user-dir "$USER_DIR" --path "$RUN/ckpt/checkpoint_best.pt" \
  --beam 4 --lenpen 0.6 --remove-bpe --batch-size 128 $([ "$DRY_RUN" = 1 ] && echo --cpu) \
  > "$RUN/generate.out" 2> "$RUN/generate.log"
tail -n 1 "$RUN/generate.out" | sed 's/^/    fairseq-generate: /'
# What fairseq's scripts/compound_split_bleu.sh does: split hyphenated compounds ("Café-Liebhaber" ->
# "Café ##AT##-##AT## Liebhaber") on both sides, then tokenized BLEU. Inflates scores; it is what
# the Transformer papers report, so it is what their numbers compare with.
compound_split() { perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'; }
grep ^H "$RUN/generate.out" | sed 's/^H-//' | sort -n -k 1 | cut -f 3 | compound_split > "$RUN/hyp.compound"
grep ^T "$RUN/generate.out" | sed 's/^T-//' | sort -n -k 1 | cut -f 2 | compound_split > "$RUN/ref.compound"
fairseq_tool score --sys "$RUN/hyp.compound" --ref "$RUN/ref.compound" 2>/dev/null | grep BLEU \
  | tee "$RUN/bleu.txt" | sed 's/^/    compound-split: /'
finish
