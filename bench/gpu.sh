#!/usr/bin/env bash
# One GPU benchmark, well under 8 minutes on an H100/H200 (torch 2.11+, no internet):
# ViT-B-16 CLIP training in bf16 on synthetic data -- samples/s and MFU of mmtrain's step beside
# OpenCLIP's same model in the same run, peak memory vs the planner at 3 batch sizes (with and
# without activation checkpointing), compiled vs eager, fp8 through torchao vs bf16 (loss
# beside), device->host syncs per step (torch.cuda.set_sync_debug_mode), a 1B LM's tokens/s,
# MFU and peak memory, Qwen2.5-VL-7B's vision tower on letter pages at their own size (pages/s,
# MFU, peak memory vs the planner), DiT-XL/2's images/s (flow matching, bf16), checkpoint save time, and the
# data path (pinned uint8 pixels normalised on the GPU, equal to the workers' float32), and
# sequence parallelism's CUDA path on one GPU (all-to-all and ring kernels vs the unsplit step),
# `mmtrain doctor`'s memory finding on a real run beside a fragmented ballast, and the GPU path's
# checks (issue 41): attention kernels and q/k/v dtypes, fused ring blocks, an FSDP2 step with 4
# micro-batches (peak vs plan, foreach clip, event timing, DCP round trip), a frozen LM's
# stage-1 memory, a native VLM's syncs under sync debug mode and its recompiles over page sizes,
# eight Qwen2.5-7B decoder layers with the real head (packed / padded, eager / compiled: MFU,
# graphs, the loss's share), the VLM loader's pages/s with 14 workers, FSDP2 CPU offload and
# QLoRA (peak GPU memory, step time, host memory vs the plan), a 1.1B LM's DPO step with each of
# its three references (LoRA adapters disabled, cached log-probs looked up by pair, a frozen
# copy: ms/step, peak vs the plan, syncs per step, the reference pass's pairs/s); planned for
# the card it runs on.
#
#   bash bench/gpu.sh                 # results in $OUT (default /tmp/mmtrain-gpu-bench): gpu_results.{md,json}
#   bash bench/gpu.sh --dry-run       # tiny sizes on the CPU: proves the script runs
#   bash bench/gpu.sh --part gpu-path # or cases: what a run whose 400 s budget ran out skipped
#                                     # (the results' notes name each skipped case)
#
# open_clip and torchao are optional: put their wheels (and open_clip's needs: ftfy, regex,
# timm, huggingface_hub, ...) in .whl/ and they are installed offline into /tmp/site first.
# Copy the table of gpu_results.md into bench/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/mmtrain-gpu-bench}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" \
    || echo "wheels in .whl/ did not install; going on without them" >&2
fi
# mmtrain from this checkout, without installing it (src/ layout); bench/ for its helpers.
export PYTHONPATH="$PWD/src:$PWD/bench:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
timeout 450 "$PY" bench/gpu_bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_bench.log"
