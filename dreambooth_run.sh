#!/usr/bin/env bash
# DreamBooth on Ray, Steps 0-6, as one script for a laptop or a Ray cluster's head node.
#
#   ./dreambooth_run.sh                     SD 1.4, the example dog photos, $NUM_WORKERS GPU workers
#   ./dreambooth_run.sh --tiny              built-in tiny model + images/toy, offline on CPU (~3 min)
#   ./dreambooth_run.sh --skip_image_setup  keep the photos already in $IMAGES_OWN_DIR
#   ./dreambooth_run.sh --use_lora          LoRA adapters instead of every weight (combines with the above)
#   ./dreambooth_run.sh --skip_eval         stop after Step 5 (no scores of the tuned model)
#
# Every variable below can be set in the environment first. On a cluster, set DATA_PREFIX
# to shared storage (NFS): workers read the model and images and write checkpoints there.
# With RAY_ADDRESS set (or `ray start` run on this node) the scripts join that cluster and
# ship this folder's code to the workers through Ray's runtime environment.
set -euo pipefail

tiny=false
skip_image_setup=false
use_lora=false
skip_eval=false
for arg in "$@"; do
  case "$arg" in
    --tiny) tiny=true ;;
    --skip_image_setup) skip_image_setup=true ;;
    --use_lora) use_lora=true ;;
    --skip_eval) skip_eval=true ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "dreambooth_run.sh: error: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")"
PYTHON="${PYTHON:-python}"

# Step 0: where everything lands
if $tiny; then
  export HF_HUB_OFFLINE=1
  export DATA_PREFIX="${DATA_PREFIX:-/tmp/dreambooth-tiny}"
  export NUM_WORKERS="${NUM_WORKERS:-2}"
  NUM_CLASS_IMAGES="${NUM_CLASS_IMAGES:-20}"
  MAX_TRAIN_STEPS="${MAX_TRAIN_STEPS:-20}"
  NUM_INFERENCE_STEPS="${NUM_INFERENCE_STEPS:-10}"
  NUM_EVAL_IMAGES="${NUM_EVAL_IMAGES:-1}"
else
  export DATA_PREFIX="${DATA_PREFIX:-/tmp}"
  export NUM_WORKERS="${NUM_WORKERS:-2}"
  NUM_CLASS_IMAGES="${NUM_CLASS_IMAGES:-200}"
  MAX_TRAIN_STEPS="${MAX_TRAIN_STEPS:-200}"
  NUM_INFERENCE_STEPS="${NUM_INFERENCE_STEPS:-50}"
  NUM_EVAL_IMAGES="${NUM_EVAL_IMAGES:-4}"
fi
export ORIG_MODEL_NAME="${ORIG_MODEL_NAME:-CompVis/stable-diffusion-v1-4}"
export ORIG_MODEL_HASH="${ORIG_MODEL_HASH:-b95be7d6f134c3a9e62ee616f310733567f069ce}"
export ORIG_MODEL_DIR="${ORIG_MODEL_DIR:-$DATA_PREFIX/model-orig}"
export ORIG_MODEL_PATH="$ORIG_MODEL_DIR/models--${ORIG_MODEL_NAME/\//--}/snapshots/$ORIG_MODEL_HASH"
export TUNED_MODEL_DIR="${TUNED_MODEL_DIR:-$DATA_PREFIX/model-tuned}"
export IMAGES_REG_DIR="${IMAGES_REG_DIR:-$DATA_PREFIX/images-reg}"
export IMAGES_OWN_DIR="${IMAGES_OWN_DIR:-$DATA_PREFIX/images-own}"
export IMAGES_NEW_DIR="${IMAGES_NEW_DIR:-$DATA_PREFIX/images-new}"
export EVAL_MODELS_CACHE="${EVAL_MODELS_CACHE:-$DATA_PREFIX/model-eval}"  # DINO and CLIP for Step 6
export EVAL_DIR="${EVAL_DIR:-$DATA_PREFIX/eval}"
export EVAL_PROMPTS="${EVAL_PROMPTS:-}"  # your own prompt file; default: the 25 prompts of $SUBJECT_TYPE
# Unique token to identify our subject (e.g., a random dog vs. our unqtkn dog)
export UNIQUE_TOKEN="${UNIQUE_TOKEN:-unqtkn}"
mkdir -p "$ORIG_MODEL_DIR" "$TUNED_MODEL_DIR" "$IMAGES_REG_DIR" "$IMAGES_OWN_DIR" "$IMAGES_NEW_DIR"

# Step 1: cache the base model (the tiny one is written, not downloaded)
if $tiny; then
  ORIG_MODEL_PATH="$($PYTHON cache_model.py --model_dir="$ORIG_MODEL_DIR" --tiny | tail -n 1)"
else
  ORIG_MODEL_PATH="$($PYTHON cache_model.py --model_dir="$ORIG_MODEL_DIR" --model_name="$ORIG_MODEL_NAME" \
    --revision="$ORIG_MODEL_HASH" | tail -n 1)"
fi
export ORIG_MODEL_PATH
echo "base model: $ORIG_MODEL_PATH"

# Step 2: photos of the subject
if $skip_image_setup; then
  echo "Skipping image setup: using the photos in $IMAGES_OWN_DIR"
  export CLASS_NAME="${CLASS_NAME:?set CLASS_NAME to the class of your subject, e.g. dog}"
elif $tiny; then
  export CLASS_NAME="${CLASS_NAME:-toy}"
  export SUBJECT_TYPE="${SUBJECT_TYPE:-object}"
  cp -f images/toy/*.jpg "$IMAGES_OWN_DIR/"
else
  export CLASS_NAME="${CLASS_NAME:-dog}"
  export SUBJECT_TYPE="${SUBJECT_TYPE:-live}"
  $PYTHON download_example_dataset.py ./images/dog
  cp -f ./images/dog/* "$IMAGES_OWN_DIR/"
fi

# Step 3: class (regularisation) images from the base model; reruns only top up
$PYTHON generate.py \
  --model_dir="$ORIG_MODEL_PATH" \
  --output_dir="$IMAGES_REG_DIR" \
  --prompts="photo of a $CLASS_NAME" \
  --num_samples_per_prompt="$NUM_CLASS_IMAGES" \
  --num_inference_steps="$NUM_INFERENCE_STEPS" \
  --use_ray_data

# Step 4: fine-tune UNet + text encoder with the prior-preservation loss
# (with --use_lora: LoRA adapters on both, at LoRA's usual learning rate)
if $use_lora; then
  TRAIN_OPTIONS=(--use_lora --lr="${LEARNING_RATE:-1e-4}")
  GENERATE_OPTIONS=(--model_dir="$ORIG_MODEL_PATH" --lora_weights_dir="$TUNED_MODEL_DIR")
else
  TRAIN_OPTIONS=(--lr="${LEARNING_RATE:-5e-6}")
  GENERATE_OPTIONS=(--model_dir="$TUNED_MODEL_DIR")
fi
$PYTHON train.py \
  --model_dir="$ORIG_MODEL_PATH" \
  --output_dir="$TUNED_MODEL_DIR" \
  --instance_images_dir="$IMAGES_OWN_DIR" \
  --instance_prompt="photo of $UNIQUE_TOKEN $CLASS_NAME" \
  --class_images_dir="$IMAGES_REG_DIR" \
  --class_prompt="photo of a $CLASS_NAME" \
  --train_batch_size=2 \
  --num_epochs=4 \
  --max_train_steps="$MAX_TRAIN_STEPS" \
  --num_workers="$NUM_WORKERS" \
  "${TRAIN_OPTIONS[@]}"

# Step 5: images of the subject from the tuned model (fresh each run)
rm -rf "${IMAGES_NEW_DIR:?}"/*.png "$IMAGES_NEW_DIR/grid"
$PYTHON generate.py \
  "${GENERATE_OPTIONS[@]}" \
  --output_dir="$IMAGES_NEW_DIR" \
  --prompts="photo of a $UNIQUE_TOKEN $CLASS_NAME in a bucket" \
  --num_samples_per_prompt=5 \
  --num_inference_steps="$NUM_INFERENCE_STEPS"

echo "tuned model in $TUNED_MODEL_DIR, new images in $IMAGES_NEW_DIR (contact sheet: $IMAGES_NEW_DIR/grid/grid.png)"
if $skip_eval; then
  exit 0
fi

# Step 6: does it look like the subject? The DreamBooth paper's scores (DINO, CLIP-I, CLIP-T, DIV,
# PRES) of the tuned model beside the base model, over a 25-prompt set (evaluate.py)
if $tiny; then EVAL_FLAGS=(--tiny); else EVAL_FLAGS=(); fi
EVAL_MODELS_DIR="$($PYTHON cache_model.py --model_dir="$EVAL_MODELS_CACHE" --eval_models "${EVAL_FLAGS[@]}" | tail -n 1)"
$PYTHON evaluate.py \
  --model_dir="$TUNED_MODEL_DIR" \
  --instance_data_dir="$IMAGES_OWN_DIR" \
  --unique_token="$UNIQUE_TOKEN" \
  --class_name="$CLASS_NAME" \
  --subject_type="${SUBJECT_TYPE:-object}" \
  ${EVAL_PROMPTS:+--eval_prompts="$EVAL_PROMPTS"} \
  --eval_models_dir="$EVAL_MODELS_DIR" \
  --output_dir="$EVAL_DIR" \
  --num_samples_per_prompt="$NUM_EVAL_IMAGES" \
  --num_inference_steps="$NUM_INFERENCE_STEPS"

echo "done: scores of the tuned model beside the base model in $EVAL_DIR/report.md"
