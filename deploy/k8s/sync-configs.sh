#!/bin/sh
# Copy the stack configs into the overlays (kustomize reads no file outside a kustomization's folder), so each
# overlay's ConfigMap dgrpo-config is exactly the config compose and `dgrpo up` use.
# tests/deploy/test_k8s.py fails, naming this script, when a copy differs from its source.
set -e
cd "$(dirname "$0")"
cp ../../configs/cpu-demo.yaml overlays/cpu/stack.yaml
cp ../../configs/cuda-node.yaml overlays/cuda/stack.yaml
cp ../../configs/npu-node.yaml overlays/npu/stack.yaml
