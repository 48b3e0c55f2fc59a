#!/usr/bin/env bash
# Stage 4 against two controls, from one stage-3 checkpoint per seed (docs/RESULTS.md, 2026-12-02).
#
#   ROOT=/tmp/ctl SEEDS="0 1 2" experiments/stage4_control.sh && python experiments/stage4_control_report.py /tmp/ctl
#
# ARGS="--flag value ..." is added to every command (every arm and the run that prepares them).
# ARMS="trained control permuted" (the default) picks the arms, run in that order.
#
# Per seed: the default command runs stages 1-3 into ROOT/sS/base and is stopped as it prints the stage-4
# header (its checkpoint.pt is then the stage-3 end, stage 4 step 0: written before the header, and the next
# one comes only after the first stage-4 step). Copies of that directory resume stage 4: "trained" as the
# default; "control" with --ppo.lr-actor 0 (a frozen actor: its AdamW steps are zero; the critic trains as
# usual); "permuted" with --agent.permute-rewards (the actor and critic train on each step's rewards dealt out by a
# uniform random permutation: the same rewards and update sizes, no tie between an episode and its reward). All
# restore the checkpoint's RNG state, so they run the same probe and draw the same per-step sampling seeds and
# task order. One training at a time, niced.
set -u
cd "$(dirname "$0")/.."
ROOT=${ROOT:-/tmp/ctl}
for s in ${SEEDS:-0 1 2}; do
  D=$ROOT/s$s; B=$D/base; mkdir -p "$D"
  echo "seed $s prep start $(date +%T) $(uptime)" >> "$ROOT/times"
  t0=$(date +%s)
  setsid nice -n 10 python cuda_agent.py train --out "$B" --seed "$s" ${ARGS:-} > "$D/prep.log" 2>&1 &
  pid=$!
  while kill -0 $pid 2>/dev/null; do
    if grep -q "==== stage 4)" "$D/prep.log"; then kill -TERM -- -$pid; break; fi
    sleep 0.5
  done
  wait $pid
  echo "seed $s prep $(( $(date +%s) - t0 )) s" >> "$ROOT/times"
  python -c "import torch; ck = torch.load('$B/checkpoint.pt', map_location='cpu', weights_only=False); \
print('seed $s base checkpoint stage', ck['stage'], 'step', ck['step'])" >> "$ROOT/times"
  for arm in ${ARMS:-trained control permuted}; do
    rm -rf "${D:?}/$arm"; cp -a "$B" "$D/$arm"
    case $arm in
      trained) extra="" ;;
      control) extra="--ppo.lr-actor 0" ;;
      permuted) extra="--agent.permute-rewards" ;;
      *) echo "unknown arm $arm (trained, control, permuted)" >&2; exit 2 ;;
    esac
    echo "seed $s $arm start $(date +%T) $(uptime)" >> "$ROOT/times"
    /usr/bin/time -v nice -n 10 python cuda_agent.py train --out "$D/$arm" --seed "$s" --resume ${ARGS:-} $extra \
      > "$D/$arm.log" 2>&1
    echo "seed $s $arm rc $? end $(date +%T) $(uptime)" >> "$ROOT/times"
  done
done
