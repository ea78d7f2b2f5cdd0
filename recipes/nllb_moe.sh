#!/usr/bin/env bash
# NLLB-200 MoE (54.5B, 128 experts) on stock fairseq with this plugin: import the released files,
# generate with the experts in one process or sharded over the GPUs of one node, and fine-tune with
# the flags of NLLB's README (examples/nllb/modeling/README.md on fairseq's nllb branch).
#
#   bash recipes/nllb_moe.sh              # the released model (download it first, below); GPUs
#   bash recipes/nllb_moe.sh --dry-run    # a tiny lookalike of the release (recipes/nllb_tiny_set.py), on CPU
#   TINY_VARIANT=first-half bash recipes/nllb_moe.sh --dry-run   # ... holding only rank files 0..E-1
#
# Downloads (the links of NLLB's README; it asks for `wget --trust-server-names <url>`), into MODEL_DIR:
#   the model, "NLLB-200 | MoE-128 | transformer_24_24_big | 54.5B": https://tinyurl.com/nllb200moe54bmodel , a
#   tarball that unpacks into model_moe_54b/ with checkpoint_2_300000-shared.pt and checkpoint_2_300000-rank-{0..255}.pt
#   (MODEL_DIR may be model_moe_54b/ or the directory it was unpacked in; 256 rank files: trained on 256 GPUs, so
#   each of the 128 experts has a replica, the README's replication_count 2). Ranks 128..255 hold replicas only:
#   keeping only rank files 0..127 (as transformers' converter and pasero read them) is enough; the import says so.
#   The dictionary (DICT, dictionary.txt): https://tinyurl.com/nllb200dictionary . The SentencePiece model (SPM,
#   flores200_sacrebleu_tokenizer_spm.model): https://tinyurl.com/flores200sacrebleuspm . The 202-language list
#   (LANGS, langs.txt): examples/nllb/modeling/scripts/flores200/langs.txt on fairseq's nllb branch, one line of
#   comma-separated codes, in that order: it fixes the language tokens' ids; passed to fairseq as --langs, the comma
#   list stock fairseq reads. A missing one stops the recipe with a line naming its download (recipes/nllb_files.py).
#   And DATA, your bitext binarized with that SPM and dictionary
#   (fairseq-preprocess -s SRC -t TGT --srcdict DICT --tgtdict DICT).
# Stages: import (import-fairseq-moe checks DICT and LANGS against the embedding: NLLB's dictionary
#   has 3 data-source tags after the language tokens, so the task is translation_multi_simple_epoch_nllb
#   --add-data-source-prefix-tags); generate (bf16: about 109 GB of weights, one H200 in one process, or
#   GPUS workers each holding 128/GPUS experts; the dry run does both, from a set for GPUS=2 workers);
#   fine-tune (--restore-file the import, reset_all). Disk, memory and time: docs/interop.md.
# Fine-tuning 54.5B with Adam needs far more than one node (NLLB's config: 16 nodes x 8 GPUs, FSDP):
#   run the printed command with torchrun on every node, or set FINETUNE=0.
# Outputs (under WORK): imported/ (the set), generate.out (one process), generate-sharded.out (GPUS workers),
#   generate-{fp16,bf16}.out, finetune/ (train.log, ckpt/).
#
# Knobs (environment; defaults in brackets):
#   WORK [./work-dirs/nllb_moe]   MODEL_DIR [./nllb-200-moe]   PREFIX [checkpoint_2_300000]
#   DICT [dictionary.txt]  SPM [flores200_sacrebleu_tokenizer_spm.model]  LANGS [langs.txt]  (each looked for in
#   MODEL_DIR, model_moe_54b/ and the directory above it)
#   DATA [required unless --dry-run]   SRC [eng_Latn] TGT [fra_Latn]   GPUS [8] (1: one process)
#   BEAM [4] GEN_SUBSET [test] MAX_SENTENCES [16]   TINY_VARIANT [replicas] (--dry-run: or first-half)
#   PRECISION_CHECK [1 with --dry-run or GPUS=1]
#   FINETUNE [1] DROPOUT [0.3] LR [5e-05] WARMUP [10] MAX_UPDATE [50] MAX_TOKENS [250] UPDATE_FREQ [16]
#   DDP_BACKEND [fully_sharded]   (the README's: --moe-eom 0.2 --moe-gate-loss-wt 0, lr 5e-5, warmup 10,
#   50 updates, 250 tokens per GPU; UPDATE_FREQ 16 on 8 GPUs keeps its 128 GPUs' batch)
set -euo pipefail
cd "$(dirname "$0")/.."
source recipes/lib/common.sh
recipe_args "$@"

if [ "$DRY_RUN" = 1 ]; then
  : "${WORK:=./work-dirs/nllb_moe_dry_run}" "${GPUS:=2}" "${MAX_UPDATE:=3}" "${WARMUP:=2}" "${MAX_TOKENS:=400}"
  : "${UPDATE_FREQ:=1}" "${DDP_BACKEND:=legacy_ddp}" "${LR:=1e-3}" "${DROPOUT:=0.1}"
fi
: "${WORK:=./work-dirs/nllb_moe}" "${MODEL_DIR:=./nllb-200-moe}" "${PREFIX:=checkpoint_2_300000}"
: "${SRC:=eng_Latn}" "${TGT:=fra_Latn}" "${GPUS:=8}" "${BEAM:=4}" "${GEN_SUBSET:=test}" "${MAX_SENTENCES:=16}"
: "${FINETUNE:=1}" "${DROPOUT:=0.3}" "${LR:=5e-05}" "${WARMUP:=10}" "${MAX_UPDATE:=50}" "${MAX_TOKENS:=250}"
: "${UPDATE_FREQ:=16}" "${DDP_BACKEND:=fully_sharded}"

STAGES=5
echo "==> [1/$STAGES] environment"
setup_environment

stage 2 "the NLLB-200 MoE files"
if [ "$DRY_RUN" = 1 ]; then
  : "${TINY_VARIANT:=replicas}"
  case $TINY_VARIANT in
    replicas) tiny_flags=() ;;
    first-half) tiny_flags=(--first-experts-only) ;;
    *) echo "$0: TINY_VARIANT=$TINY_VARIANT: give replicas or first-half" >&2; exit 2 ;;
  esac
  MODEL_DIR=$WORK/tiny_nllb DATA=$WORK/data-bin  # laid out as the downloads: the checkpoints in model_moe_54b/
  if needs_run "$MODEL_DIR/.done" "tiny-3 $TINY_VARIANT"; then
    rm -rf "$MODEL_DIR" "$DATA"
    python recipes/nllb_tiny_set.py "$MODEL_DIR" --data-bin "$DATA" "${tiny_flags[@]}" 2>&1 | grep -v "INFO" \
      | sed 's/^/    /'
    mark_done "$MODEL_DIR/.done" "tiny-3 $TINY_VARIANT"
  fi
fi
# MODEL_DIR as unpacked (model_moe_54b/ or its parent), DICT, SPM (real text only) and LANGS: found, or one line
# naming the missing file's download.
files=$(python recipes/nllb_files.py "$MODEL_DIR" "$PREFIX" "${DICT:-}" "${SPM:-}" "${LANGS:-}" \
        $([ "$DRY_RUN" = 1 ] || echo --need-spm)) || exit 2
eval "$files"
if [ -z "${DATA:-}" ] || [ ! -d "$DATA" ]; then
  echo "$0: DATA=${DATA:-} is not a directory: binarize your $SRC-$TGT bitext with NLLB's SPM and dictionary (see --help)" >&2
  exit 2
fi
echo "    $(ls "$CKPT_DIR" | grep -c -- "$PREFIX-rank-") rank files + $PREFIX-shared.pt in $CKPT_DIR; data $DATA"
# LANGS as stock fairseq's --langs reads it: one comma list (NLLB's langs.txt is one; a file of one code per
# line works too). An empty or duplicated list stops here.
LANG_LIST=$(python recipes/nllb_langs.py "$LANGS")

stage 3 "import-fairseq-moe for $GPUS worker(s), dictionary checked against the embedding"
imported=$WORK/imported/model.pt
if needs_run "$WORK/imported/.done" "$CKPT_DIR/$PREFIX $GPUS $DICT $LANGS"; then
  rm -rf "$WORK/imported"
  mkdir -p "$WORK/imported"
  python -m fairseq_moe_ext.checkpoint import-fairseq-moe "$CKPT_DIR/$PREFIX" "$imported" --world-size "$GPUS" \
    --dictionary "$DICT" --langs "$LANGS" | tee "$WORK/imported/import.log" | sed 's/^/    /'
  mark_done "$WORK/imported/.done" "$CKPT_DIR/$PREFIX $GPUS $DICT $LANGS"
fi

# The multilingual task as NLLB ran it: language tokens from LANGS (their order fixes their ids), the source's
# on the encoder side and the target's first in the decoder, and the 3 data-source tags after them.
task_args=(
  "$DATA" --user-dir "$USER_DIR" --task translation_multi_simple_epoch_nllb --add-data-source-prefix-tags
  --langs "$LANG_LIST" --lang-pairs "$SRC-$TGT" --source-lang "$SRC" --target-lang "$TGT"
  --encoder-langtok src --decoder-langtok --num-workers 0
)
if [ "$DRY_RUN" = 1 ]; then
  device=(--cpu)
else
  device=(--bf16)
fi

stage 4 "fairseq-generate $GEN_SUBSET $SRC-$TGT (beam $BEAM; $([ "$GPUS" -gt 1 ] && echo "experts sharded over $GPUS workers" || echo "one process"))"
gen_args=("${task_args[@]}" --path "$imported" --gen-subset "$GEN_SUBSET" --beam "$BEAM"
          --max-sentences "$MAX_SENTENCES" "${device[@]}")
if [ "$DRY_RUN" = 1 ]; then
  gen_args+=(--max-len-a 1 --max-len-b 4)  # random weights rarely stop on their own
else
  gen_args+=(--bpe sentencepiece --sentencepiece-model "$SPM" --scoring sacrebleu)
fi
if [ "$GPUS" = 1 ] || [ "$DRY_RUN" = 1 ]; then
  # One process holding every expert (a set imported for several workers is merged as it loads).
  fairseq_tool generate "${gen_args[@]}" > "$WORK/generate.out" 2>&1
  echo "    one process: $(grep -c '^H-' "$WORK/generate.out") hypotheses; $(grep -E 'BLEU' "$WORK/generate.out" | tail -1)"
fi
if [ "$GPUS" -gt 1 ]; then
  # Each worker holds 128/GPUS experts (the set was imported for GPUS workers) and prints its own sentences.
  python -m torch.distributed.run --standalone --nproc_per_node "$GPUS" "$FAIRSEQ_BIN/fairseq-generate" \
    "${gen_args[@]}" --distributed-world-size "$GPUS" > "$WORK/generate-sharded.out" 2>&1
  echo "    $GPUS workers: $(grep -c '^H-' "$WORK/generate-sharded.out") hypotheses;" \
    "$(grep -E 'BLEU' "$WORK/generate-sharded.out" | tail -1)"
fi

# ---- expert pruning (issue 45; docs/checkpoints.md "Expert pruning"): routing statistics of the import on
# STATS_SUBSET of your SRC-TGT bitext (the encoder's counts keyed by SRC, the decoder's by TGT), the experts
# they rank highest for that pair kept (PRUNE_FRACTION of each layer's), and generation from the pruned set.
# PRUNE [1] (0: skip)   PRUNE_FRACTION [0.25; --dry-run 0.5, the tiny set has 4 experts and k=2]
# STATS_SUBSET [valid; --dry-run test]   the pruned set: WORK/pruned/model.pt, its output WORK/generate_pruned.out
if [ "$DRY_RUN" = 1 ]; then : "${PRUNE_FRACTION:=0.5}" "${STATS_SUBSET:=$GEN_SUBSET}"; fi
: "${PRUNE:=1}" "${PRUNE_FRACTION:=0.25}" "${STATS_SUBSET:=valid}"
if [ "$PRUNE" = 1 ]; then
  echo "==> [prune] routing statistics of $STATS_SUBSET ($SRC-$TGT), keep $PRUNE_FRACTION of the experts, generate"
  launch=("$FAIRSEQ_BIN/fairseq-generate")
  [ "$GPUS" -gt 1 ] && launch=(python -m torch.distributed.run --standalone --nproc_per_node "$GPUS"
                               "$FAIRSEQ_BIN/fairseq-generate" --distributed-world-size "$GPUS")
  rm -rf "$WORK/pruned" && mkdir -p "$WORK/pruned"
  "${launch[@]}" "${gen_args[@]}" --gen-subset "$STATS_SUBSET" --moe-routing-stats "$WORK/pruned/stats.json" \
    > "$WORK/pruned/stats_generate.out" 2>&1
  python -m fairseq_moe_ext.checkpoint prune "$imported" "$WORK/pruned/model.pt" --stats "$WORK/pruned/stats.json" \
    --keep-fraction "$PRUNE_FRACTION" --group "$SRC" --group "$TGT" --world-size "$GPUS" | sed 's/^/    /'
  # the weights at each keep fraction, from the import's own tensors, and the smallest GPU that holds them
  python recipes/pruned_memory.py "$imported" --fractions 1 0.5 0.25 0.2 0.125 2>&1 | grep -v "INFO" | sed 's/^/    /'
  "${launch[@]}" "${gen_args[@]}" --path "$WORK/pruned/model.pt" > "$WORK/generate_pruned.out" 2>&1
  echo "    pruned: $(grep -c '^H-' "$WORK/generate_pruned.out") hypotheses; $(grep -E 'BLEU' "$WORK/generate_pruned.out" | tail -1)"
fi

# ---------------- precision check: --fp16 and --bf16 generation in one process, the dtype the model ran in asserted
# fairseq-generate casts only for --fp16 (--bf16 ran fp32, twice the memory); the plugin casts for both and logs
# "the model runs in <dtype>" (fairseq_integration/run_dtype.py). One process holds all 128 experts: 109 GB in
# fp16/bf16, one H200. PRECISION_CHECK [1 with --dry-run or GPUS=1, else 0].
: "${PRECISION_CHECK:=$([ "$DRY_RUN" = 1 ] || [ "$GPUS" = 1 ] && echo 1 || echo 0)}"
if [ "$PRECISION_CHECK" = 1 ]; then
  check_args=()  # generate's own, less the device's --bf16: the precision is what this check picks
  for arg in "${gen_args[@]}"; do [ "$arg" = --bf16 ] || check_args+=("$arg"); done
  for precision in fp16:float16 bf16:bfloat16; do
    flag=${precision%%:*} dtype=${precision#*:}
    fairseq_tool generate "${check_args[@]}" "--$flag" > "$WORK/generate-$flag.out" 2>&1
    if ! grep -q "the model runs in $dtype: weights $dtype," "$WORK/generate-$flag.out"; then
      echo "$0: fairseq-generate --$flag did not run the model in $dtype: see $WORK/generate-$flag.out" >&2
      exit 1
    fi
    echo "    --$flag: the model ran in $dtype; $(grep -c '^H-' "$WORK/generate-$flag.out") hypotheses"
  done
fi
# ---------------- end of the precision check

# ---- distillation (issue 55; docs/interop.md "Distilling NLLB-200 MoE into a dense student"): the import as the
# teacher of a dense transformer (NLLB-200-distilled-600M's shape; --dry-run: 2 + 2 layers of width 64), word-level
# (--criterion moe_distillation), on the GPUS workers with the teacher's experts spread over them (its set was
# imported for GPUS workers), DISTILL_UPDATES [MAX_UPDATE] updates; then the student generates GEN_SUBSET in one
# process: WORK/distil/ (train.log, ckpt/), WORK/generate_student.out. DISTILL [1 with --dry-run, else 0]
: "${DISTILL:=$([ "$DRY_RUN" = 1 ] && echo 1 || echo 0)}" "${DISTILL_UPDATES:=$MAX_UPDATE}"
if [ "$DISTILL" = 1 ]; then
  echo "==> [distil] a dense student of the import, the teacher's experts spread over $GPUS worker(s)"
  if [ "$DRY_RUN" = 1 ]; then
    student=(--encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 64 --decoder-embed-dim 64
             --encoder-ffn-embed-dim 128 --decoder-ffn-embed-dim 128 --encoder-attention-heads 2 --decoder-attention-heads 2)
  else  # NLLB-200-distilled-600M: 12 + 12 layers, width 1024, FFN 4096, 16 heads, pre-norm, shared embeddings
    student=(--encoder-layers 12 --decoder-layers 12 --encoder-embed-dim 1024 --decoder-embed-dim 1024
             --encoder-ffn-embed-dim 4096 --decoder-ffn-embed-dim 4096 --encoder-attention-heads 16
             --decoder-attention-heads 16 --encoder-normalize-before --decoder-normalize-before --share-all-embeddings)
  fi
  rm -rf "$WORK/distil"
  train_workers "$GPUS" "$WORK/distil/train.log" "${task_args[@]}" --arch transformer "${student[@]}" \
    --criterion moe_distillation --label-smoothing 0.1 --distill-teacher "$imported" --distill-weight 0.5 \
    --optimizer adam --adam-betas "(0.9, 0.98)" --lr "$LR" --lr-scheduler inverse_sqrt --warmup-updates "$WARMUP" \
    --max-update "$DISTILL_UPDATES" --max-tokens "$MAX_TOKENS" --ddp-backend "$DDP_BACKEND" --no-epoch-checkpoints \
    --save-dir "$WORK/distil/ckpt" --log-format json --log-interval 1 "${device[@]}" > /dev/null
  fairseq_tool generate "${gen_args[@]}" --path "$WORK/distil/ckpt/checkpoint_last.pt" > "$WORK/generate_student.out" 2>&1
  echo "    $(grep -oE 'distillation teacher [^:]*: [0-9,]+ parameters on this worker, [^,]*' "$WORK/distil/train.log" | head -1)"
  echo "    student: $(grep -oE 'done training in [0-9.]+ seconds' "$WORK/distil/train.log");" \
    "$(grep -c '^H-' "$WORK/generate_student.out") hypotheses"
fi

stage 5 "fine-tune: $MAX_UPDATE updates from the import (lr $LR, warmup $WARMUP, dropout $DROPOUT, --moe-eom 0.2, gate loss 0, --moe-normalize-expert-grad sqrt_world_size)"
if [ "$FINETUNE" != 1 ]; then
  echo "    skipped (FINETUNE=$FINETUNE)"
  finish
  exit 0
fi
# fairseq-train builds the model from its flags, also when restoring: the import's own shape and MoE flags, and
# the gate-loss combination the release's criterion recorded (sum), which the import keeps.
read -r -a model_args <<< "$(python recipes/checkpoint_flags.py "$imported")"
# NLLB's fine-tuning (README "Finetuning NLLB models", MoE; sweep_mmt.py's optimisation flags), mapped here:
# --moe-gate-loss-wt 0 as the README; fairseq's adam with NLLB's betas and eps, inverse_sqrt from 1e-7, no
# clipping, label smoothing 0.1; reset_all = fairseq's four --reset-* flags; sweep_mmt.py gives every MoE run
# --moe-normalize-expert-grad sqrt_world_size (expert gradients sqrt(P) times the exact ones).
train_args=(
  "${task_args[@]}" --arch moe_transformer "${model_args[@]}" --dropout "$DROPOUT"
  --moe-normalize-expert-grad sqrt_world_size
  --criterion moe_label_smoothed_cross_entropy --label-smoothing 0.1 --moe-gate-loss-wt 0
  --sampling-method temperature --sampling-temperature 1
  --optimizer adam --adam-betas "(0.9, 0.98)" --adam-eps 1e-06 --weight-decay 0.0 --clip-norm 0.0
  --lr "$LR" --lr-scheduler inverse_sqrt --warmup-init-lr 1e-07 --warmup-updates "$WARMUP"
  --max-update "$MAX_UPDATE" --max-tokens "$MAX_TOKENS" --update-freq "$UPDATE_FREQ"
  --restore-file "$imported" --reset-optimizer --reset-dataloader --reset-meters --reset-lr-scheduler
  --validate-interval-updates 10 --save-interval-updates 50 --keep-interval-updates 1 --no-epoch-checkpoints
  --best-checkpoint-metric nll_loss --ddp-backend "$DDP_BACKEND" --save-dir "$WORK/finetune/ckpt"
  --log-format json --log-interval 1 "${device[@]}"
)
rm -rf "$WORK/finetune"
train_workers "$GPUS" "$WORK/finetune/train.log" "${train_args[@]}" > /dev/null
echo "    $(grep -oE 'done training in [0-9.]+ seconds' "$WORK/finetune/train.log"); valid nll_loss by epoch:" \
  "$(grep -oE '"valid_nll_loss": "[0-9.]+"' "$WORK/finetune/train.log" | grep -oE '[0-9.]+' | tr '\n' ' ')"
finish
