#!/usr/bin/env bash
# Train the EAGLE-3 drafter that ships with eyas for the default model (SmolLM2-135M-Instruct), from
# scratch, on a 2-core CPU in about 2 hours, and install it into eyas/drafters/:
#
#   bash scripts/train_default_drafter.sh [WORK_DIR]        (default WORK_DIR: ./drafter-run)
#
# 1. extract, twice, all inside the first 13,000 ShareGPT conversations (the training split; 13,000 on
#    are held out), cut to $MAX_LEN tokens, hidden states of layers 2, 15, 27 (the EAGLE-3 aux streams)
#    and 30 (the final layer, for the target distribution) in bfloat16, which CPUs with AMX/AVX512-BF16
#    run about twice as fast as float32:
#    a. the first $SAMPLES conversations with each assistant turn regenerated greedily by the target
#       itself (self-distillation: the text the drafter will see when serving); decoding makes this
#       slow, about 45 minutes for 1,280 conversations on an AMX CPU;
#    b. the first $PREFILL_SAMPLES conversations with their original replies: one prefill each, about
#       2,800 tokens/s, so about 18 minutes for 6,000 (5x the data of a, at 2.5 GB per 1,000).
#    Both are resumable: re-run the script after a crash.
# 2. train: EAGLE-3 with training-time test on both folders at once, one pass, then the engine
#    measures acceptance on held-out prompts and writes the model card. Resumable the same way.
# 3. install: the folder (bf16 weights, model card, plot) is copied to eyas/drafters/.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-drafter-run}
SAMPLES=${SAMPLES:-1280}
MAX_LEN=${MAX_LEN:-640}
PREFILL_SAMPLES=${PREFILL_SAMPLES:-6000}
EPOCHS=${EPOCHS:-1}
mkdir -p "$WORK"
eyas extract --data sharegpt --out "$WORK/dumps" --max-samples "$SAMPLES" --regenerate --max-len "$MAX_LEN" \
    --regen-max-tokens 256 --layers 2,15,27,30 --dtype bfloat16 --max-num-seqs 128 --max-num-batched-tokens 4096 \
    --chunk-size 256
eyas extract --data sharegpt --out "$WORK/prefill" --max-samples "$PREFILL_SAMPLES" --max-len "$MAX_LEN" \
    --layers 2,15,27,30 --dtype bfloat16 --max-num-batched-tokens 4096 --chunk-size 500
eyas train eagle3 --data "$WORK/dumps" "$WORK/prefill" --out "$WORK/eagle3" --draft-vocab-size 8192 \
    --unroll-steps 4 --epochs "$EPOCHS" --lr 2e-3 --warmup-steps 20 --batch-tokens 4096 --max-len "$MAX_LEN" \
    --checkpoint-every 50 --eval-prompts 8 --eval-tokens 128
DEST=eyas/drafters/smollm2-135m-instruct-eagle3
mkdir -p "$DEST"
cp "$WORK/eagle3/config.json" "$WORK/eagle3/model.safetensors" "$WORK/eagle3/README.md" "$WORK/eagle3/training.png" \
    "$WORK/eagle3/metrics.jsonl" "$DEST/"
echo "installed the drafter in $DEST"
