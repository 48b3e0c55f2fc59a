"""Where a training run's wall time goes: `python cuda_agent.py train ARGS` with timers around generation
(policy.HFPolicy.act), sandbox checks (env.Episode.check, verify and profile apart, cache hits included), the
rollouts as a whole (env.run_episodes), scoring (ppo.score) and the PPO update (ppo.ppo_update). Prints one
JSON line `PROF {name: [seconds, calls], ..., "total": seconds}` at exit. Checks run on env's thread pool, so
their seconds add up over threads (a queued check counts its wait for a sandbox slot); the rest is wall time.

  python experiments/stage4_control_profile.py train --out DIR --resume      (e.g. a copy of ROOT/sN/base of
                                                                           experiments/stage4_control.sh)
"""
import atexit
import collections
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cuda_agent  # noqa: E402
import env  # noqa: E402
import policy  # noqa: E402
import ppo  # noqa: E402

SECONDS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter = collections.Counter()
LOCK = threading.Lock()


def timed(owner, name: str, key) -> None:
    """Replace owner.name by a timed call; key: a label, or a function of (args, kwargs) giving one."""
    f = getattr(owner, name)

    def g(*a, **k):
        t0 = time.time()
        try:
            return f(*a, **k)
        finally:
            label = key(a, k) if callable(key) else key
            with LOCK:
                SECONDS[label] += time.time() - t0
                CALLS[label] += 1
    setattr(owner, name, g)


timed(policy.HFPolicy, "act", "generate")
timed(env.Episode, "check", lambda a, k: "check " + ("profile" if k.get("profile", a[1] if len(a) > 1 else 0)
                                                     else "verify"))
timed(env, "run_episodes", "rollouts")
timed(ppo, "score", "score")           # train.py calls these through the module, so the patch is seen
timed(ppo, "ppo_update", "ppo_update")
T0 = time.time()


@atexit.register
def report() -> None:
    out = {k: [round(SECONDS[k], 1), CALLS[k]] for k in SECONDS}
    print("PROF", json.dumps({**out, "total": round(time.time() - T0, 1)}), flush=True)


if __name__ == "__main__":
    sys.exit(cuda_agent.main(sys.argv[1:]))
