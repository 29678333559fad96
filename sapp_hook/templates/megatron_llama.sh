#!/bin/bash
# Megatron-LM pretraining launch for a small Llama (abridged).
set -euo pipefail

GPUS_PER_NODE=4
DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes 1"

torchrun $DISTRIBUTED_ARGS pretrain_gpt.py \
    --num-layers 8 \
    --hidden-size 256 \
    --num-attention-heads 8 \
    --seq-length 128 \
    --micro-batch-size 2 \
    --global-batch-size 16 \
    --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 4 \
    --decoder-first-pipeline-num-layers 1 \
    --recompute-activations \
    --bf16 \
    --lr 3e-4
