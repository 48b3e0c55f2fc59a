#!/usr/bin/env bash
# One call on the GPU machine: build, check and time everything in one go (every GPU measurement in the
# README comes from a section of this script).
#
#   scripts/device_run.sh env gpu-tests sandbox      # pick sections; default: all, in the order below
#
# Sections: env, gpu-tests, cpu-suite, sandbox, sandbox-base, kb-baselines, kb-samples, synth, generate, generate-a3b, ppo,
# train-tiny, train-ddp. Each section runs under its own time limit; logs go to $OUT/device$TAG.log, JSON
# results to $OUT/results$TAG.tgz. KernelBench problem files are read from .carry/KernelBench (not committed:
# the user supplies a checkout).
# Two lanes on a 2-GPU machine (each lane its own GPU, log, results and cache; timing never shares a GPU):
#   TAG=_g0 CUDA_VISIBLE_DEVICES=0 scripts/device_run.sh kb-baselines & \
#   TAG=_g1 CUDA_VISIBLE_DEVICES=1 scripts/device_run.sh synth; wait
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cuda_agent_out}
TAG=${TAG:-}
RES=/tmp/cuda_agent_results$TAG
mkdir -p "$OUT" "$RES"
export PYTHONUNBUFFERED=1 CUDA_AGENT_CACHE=/tmp/cuda_agent_cache$TAG
LOG="$OUT/device$TAG.log"
KB=${KB:-.carry}   # a folder holding KernelBench/level{N}/

# bubblewrap is not on the GPU image: unpack the carried Debian package (a single static-ish binary).
if ! command -v bwrap >/dev/null 2>&1 && ls .carry/debs/bubblewrap*.deb >/dev/null 2>&1; then
  dpkg -x .carry/debs/bubblewrap*.deb /tmp/bwrap_root$TAG && export PATH=/tmp/bwrap_root$TAG/usr/bin:$PATH
fi

# tyro (the command-line parser) is not on the GPU image either: install the carried wheels (tyro,
# docstring-parser, typeguard, typing-extensions) when it is missing.
if ! python3 -c "import tyro" >/dev/null 2>&1 && ls .carry/wheels/tyro-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --find-links .carry/wheels tyro
fi

section() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  echo "=== [$name] $(date +%T) limit ${limit}s: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== [$name] rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  tail -n 25 "$LOG" | sed "s/^/[$name] /"
}

want() { [ ${#SECTIONS[@]} -eq 0 ] || [[ " ${SECTIONS[*]} " == *" $1 "* ]]; }
SECTIONS=("$@")

if want env; then
  section env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
    python3 -c "import sys,torch,transformers,peft; print(sys.version.split()[0], torch.__version__, transformers.__version__, peft.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count())";
    nvcc --version | tail -1; which bwrap ncu compute-sanitizer; bwrap --version'
fi
if want gpu-tests; then
  section gpu-tests "${T_TESTS:-420}" python3 -m pytest -q -m gpu --timeout 240 -p no:cacheprovider ${GPU_TESTS:-tests/}
fi
if want cpu-suite; then  # the CPU adversarial suite on this image's Python/torch (no GPU visible to it)
  section cpu-suite "${T_CPU:-420}" env CUDA_VISIBLE_DEVICES= python3 -m pytest -q -m "not gpu and not slow" \
    -n "${CPU_WORKERS:-6}" --timeout 300 -p no:cacheprovider ${CPU_TESTS:-tests/test_sandbox.py tests/test_reward.py tests/test_cli.py}
fi
if want sandbox; then
  section sandbox "${T_SBX:-420}" python3 scripts/bench_sandbox.py --device cuda ${SBX_ARGS:-} --out "$RES/bench_sandbox.json"
fi
if want sandbox-base; then  # the same bench in an older tree (BASE, e.g. `git archive REV | tar -x -C .carry/base`)
  section sandbox-base "${T_SBX:-420}" env CUDA_AGENT_CACHE=/tmp/cuda_agent_cache_base$TAG bash -c \
    "cd ${BASE:-.carry/base} && python3 scripts/bench_sandbox.py --device cuda ${SBX_ARGS:-} --out $RES/bench_sandbox_base.json"
fi
if want kb-baselines; then
  section kb-baselines "${T_KBB:-420}" python3 scripts/bench_kernelbench_baselines.py --kernelbench-dir "$KB" --level 1 \
    --problems "${KB_PROBLEMS:-1,3,6,18,23,26,33,36,40,42,48,54,57,65,77,82,86,87}" --h100-dir .carry/h100 \
    --cache-dir "$CUDA_AGENT_CACHE" --out "$RES/kb_baselines"
fi
if want kb-samples; then
  section kb-samples "${T_KBS:-420}" python3 kernelbench_eval.py --kernelbench-dir "$KB" --level 1 2 --samples-only \
    --samples-dir scripts/kb_samples --sandbox.device cuda --sandbox.cache-dir "$CUDA_AGENT_CACHE" --out "$RES/kb_samples"
fi
if want synth; then
  section synth "${T_SYN:-420}" python3 scripts/bench_synth.py --device cuda --n-candidates 200 ${SYN_ARGS:-} --out-dir "$RES/bench_synth"
fi
if want generate; then
  section generate "${T_GEN:-300}" python3 scripts/bench_generate.py --preset small ${GEN_ARGS:-} --out "$RES/bench_generate_small.json"
fi
if want generate-a3b; then
  section generate-a3b "${T_A3B:-420}" python3 scripts/bench_generate.py --preset a3b ${A3B_ARGS:-} --out "$RES/bench_generate_a3b.json"
fi
if want ppo; then
  section ppo "${T_PPO:-480}" python3 scripts/bench_ppo.py --device cuda ${PPO_ARGS:-} --out "$RES/bench_ppo.json"
fi
if want train-tiny; then
  section train-tiny "${T_TRAIN:-480}" python3 cuda_agent.py train --device cuda --sandbox.device cuda \
    --run-dir "$RES/train_tiny" --tensorboard ${TRAIN_ARGS:-}
fi
if want train-ddp; then  # data-parallel over every visible GPU; the sandbox on CPU so no GPU times next to training
  section train-ddp "${T_DDP:-420}" accelerate launch --multi_gpu --num_processes "${DDP_PROCS:-2}" --mixed_precision no \
    cuda_agent.py train --device cuda --sandbox.device cpu --run-dir "$RES/train_ddp" ${DDP_ARGS:-}
fi

tar -czf "$OUT/results$TAG.tgz" -C "$RES" . 2>/dev/null
echo "=== done $(date +%T); results in results$TAG.tgz" | tee -a "$LOG"
