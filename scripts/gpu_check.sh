#!/usr/bin/env bash
# The GPU checks, for a machine with one CUDA GPU and a CUDA build of PyTorch (no TensorFlow
# needed): builds the numpy-only core, then
#   1. says where NCCL was found and its version;
#   2. np 1 on NCCL: collectives on CUDA tensors, exact;
#   3. np 2 on the staging path (two ranks share the GPU, which NCCL refuses): exact;
#   4. np 2: a SynchronousSGDOptimizer step on CUDA, identical weights on both workers;
#   5. the ResNet-50 gradient set's allreduce at np 2: staging against synchronous .cpu()
#      staging and against torch.distributed's gloo (benchmarks/gpu_allreduce.py).
# Output goes to stdout and to $OUT/gpu_check.log when OUT is set. Every step has a deadline.
# The build needs OpenSSL's headers and libcrypto; where the machine has none (and no network),
# carry the libssl-dev package in .deb/ (scripts/openssl_from_debs.sh says how).
set -uo pipefail
cd "$(dirname "$0")/.."
log=${OUT:-/tmp}/gpu_check.log
exec > >(tee "$log") 2>&1
PY=${PYTHON:-python3}
step() { echo; echo "== $*"; }
step "build (numpy-only core)"
# shellcheck source=scripts/openssl_from_debs.sh
. scripts/openssl_from_debs.sh
openssl_from_debs || { echo "build failed: no OpenSSL to build with"; exit 1; }
KUNGFU_BUILD_TENSORFLOW=0 timeout 300 "$PY" -m pip install -q --no-build-isolation --no-deps \
  --no-index . || { echo "build failed"; exit 1; }
export KUNGFU_GPU_COUNT=0  # both ranks on the one GPU
step "1. NCCL"
timeout 60 "$PY" -c "import kungfu.torch as k; print(k.show_nccl_version())"
step "2. np 1, NCCL, exact"
KUNGFU_GPU=nccl timeout 120 "$PY" scripts/gpu_check.py exact
step "3. np 2, staging, exact"
KUNGFU_GPU=staging timeout 180 "$PY" -m kungfu.cmd -np 2 "$PY" scripts/gpu_check.py exact
step "4. np 2, SynchronousSGDOptimizer on CUDA"
KUNGFU_GPU=staging timeout 180 "$PY" -m kungfu.cmd -np 2 "$PY" scripts/gpu_check.py optimizer
step "5. ResNet-50 gradient set at np 2: staging vs .cpu() vs gloo"
timeout 420 "$PY" benchmarks/gpu_allreduce.py --np 2 --repeats 3
echo; echo "gpu_check done"
