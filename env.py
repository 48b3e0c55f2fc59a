"""The agent environment (paper §3.2): episodes over kernel workspaces, batched, with exact token records.

  * The Policy interface (EpisodeState, Action, Policy) and the token format of a conversation:
    tokenize_conversation(messages, tools, tokenizer) -> (ids, mask) concatenates chat-template segments
    (mask 0) and each assistant turn's sampled ids (message["token_ids"], mask 1, end-of-turn included).
    The policy builds its prompts with the same function, so a stored trajectory re-tokenises to exactly
    the ids the model saw and sampled.
  * Episode: one task's workspace (tools.make_workspace), conversation and bookkeeping; its tool calls
    run through tools.py, its checks through the sandbox pool on the pristine task source (never the
    workspace copy), and reward.py turns each verdict into the reward (`EnvConfig.reward`).
  * run_episodes(policy, tasks, pool, cfg): all active episodes act together (one policy.act per turn),
    then their tool calls run on a thread pool, so episodes overlap their compiles. An episode stops on
    finish, the turn limit or the token budget; it keeps its best verdict with a snapshot of its files,
    then runs a final check. Returns one tasks.Trajectory per task.
  * The token budget (`EnvConfig.max_context_tokens`) holds before each turn, not after: the policy gets it
    in EpisodeState, samples at most what the prompt leaves of it and answers finish_reason "context" when
    nothing is left (policy.HFPolicy); the episode then stops without a turn. Observations after the last turn
    that would take the record past the budget are not recorded (no turn read them), so with a local policy
    no record exceeds the budget.

Departures from the paper
  1. Tool calls of one turn run after the whole batch has acted (a per-turn barrier), so a slow episode
     delays the next generate call.
  2. The final workspace is checked once more (profiled): "final" reward is that check, "best" the best
     verdict seen during the episode (the paper's evaluation counts the best).
  3. `profile` can add an Nsight Compute summary (`ncu`) that the released harness does not have.

Smoke: python -m pytest -q tests/test_env.py
Full:  python cuda_agent.py solve TASK.py --policy openai --model NAME --endpoint URL --device cuda
"""
from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Protocol

import reward
import sandbox
import tools
from tasks import Task, Trajectory
from workspace import WorkspaceError

# --------------------------------------------------------------------------------------------------
# The interface
# --------------------------------------------------------------------------------------------------


@dataclass
class EpisodeState:
    episode_id: int                   # stable across the episode's turns (the rollout engine's KV-cache key)
    messages: list[dict]              # chat so far, OpenAI format; assistant messages may carry "token_ids"
    tools: list[dict] | None = None   # function-calling schemas ({"type": "function", "function": {...}})
    cache: dict | None = None         # the episode's scratch for incremental tokenize_conversation (opaque)
    # the episode's token budget (None: none): a turn samples at most budget - len(prompt) - 1 tokens, one being
    # kept for the end-of-turn token that closes a cut turn; with nothing left the policy answers "context"
    max_context_tokens: int | None = None


@dataclass
class Action:
    text: str                                  # raw assistant text, tool-call markup included
    content: str = ""                          # text with the well-formed tool-call blocks removed
    tool_calls: list[dict] = field(default_factory=list)   # OpenAI format, arguments as a JSON string
    errors: list[str] = field(default_factory=list)        # one line per malformed call
    token_ids: list[int] | None = None         # sampled ids, end-of-turn token included (local policies)
    # the sampler's log-prob of each sampled id (same length): log_softmax(logits) at temperature 1, before
    # top-p/top-k, so the probability the token was drawn with only at temperature 1 without them
    logprobs: list[float] | None = None
    finish_reason: str = "stop"                # "stop" | "length" | "context" (no room left: nothing sampled)
    n_context: int | None = None               # prompt + completion tokens after this turn, if known

    def message(self) -> dict:
        """The assistant message to append to the conversation (standard chat format + token_ids)."""
        m = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        if self.token_ids is not None:
            m["token_ids"] = list(self.token_ids)
        return m


class Policy(Protocol):
    """One method. (A policy may also have `release(episode_id)`; run_episodes calls it when an episode
    ends, so a policy holding per-episode state, such as a KV cache, can free it. One whose `streams` is true
    has `stream(states, advance)` too: see policy.HFPolicy.stream.)"""
    def act(self, states: list[EpisodeState]) -> list[Action]: ...


# --------------------------------------------------------------------------------------------------
# Exact tokenisation of a conversation (render deltas)
# --------------------------------------------------------------------------------------------------


def end_of_turn(tokenizer) -> str:
    """The token that ends an assistant turn: ChatML's <|im_end|> if the vocabulary has it, else EOS."""
    return "<|im_end|>" if "<|im_end|>" in tokenizer.get_vocab() else tokenizer.eos_token


def _for_template(m: dict) -> dict:
    """A copy of a message as chat templates expect it: no token_ids, tool arguments as dicts."""
    m = {k: v for k, v in m.items() if k not in ("token_ids", "logprobs")}
    if m.get("tool_calls"):
        m["tool_calls"] = copy.deepcopy(m["tool_calls"])
        for tc in m["tool_calls"]:
            f = tc.get("function", tc)
            if isinstance(f.get("arguments"), str):
                try:
                    f["arguments"] = json.loads(f["arguments"])
                except json.JSONDecodeError:
                    pass
    if m.get("content") is None:
        m["content"] = ""
    return m


def render(messages: list[dict], tools: list[dict] | None, tokenizer, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template([_for_template(m) for m in messages], tools=tools or None,
                                         tokenize=False, add_generation_prompt=add_generation_prompt)


def _after_nth(text: str, sub: str, n: int) -> int:
    """Index just after the n-th occurrence of sub in text (0 when n == 0)."""
    pos = 0
    for _ in range(n):
        k = text.find(sub, pos)
        assert k >= 0, f"chat template rendered fewer than {n} {sub!r} markers"
        pos = k + len(sub)
    return pos


def tokenize_conversation(messages: list[dict], tools: list[dict] | None, tokenizer,
                          add_generation_prompt: bool = False, cache: dict | None = None
                          ) -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation; mask is 1 exactly on tokens the policy sampled.

    Segments: the template text before each assistant turn (mask 0), then the turn's sampled ids
    (message["token_ids"], mask 1) or, for messages without ids (scripted or API policies), the
    template's rendering of the turn up to and including the end-of-turn token (mask 1). Text between
    turns is located by counting end-of-turn markers, so templates that re-render earlier assistant
    turns differently (e.g. Qwen3 dropping empty <think> blocks) still give consistent segments.

    cache: an episode's scratch dict (EpisodeState.cache). It remembers the ids up to the last assistant
    turn, so each call renders only the new turns (a from-scratch call renders once per assistant turn,
    which is quadratic in turns). It is used only if its messages are still a prefix of `messages`.
    """
    eot = end_of_turn(tokenizer)
    eot_id = tokenizer.convert_tokens_to_ids(eot)
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False) if s else []  # noqa: E731
    ids, mask, n_eot, start = [], [], 0, 0   # n_eot: end-of-turn markers already covered by ids
    if cache and cache.get("tok") == id(tokenizer) and cache.get("tools") == tools \
            and messages[:len(cache["prefix"])] == cache["prefix"]:
        ids, mask, n_eot, start = list(cache["ids"]), list(cache["mask"]), cache["n_eot"], len(cache["prefix"])
    for i in range(start, len(messages)):
        m = messages[i]
        if m["role"] != "assistant":
            continue
        r = render(messages[:i], tools, tokenizer, True)
        seg = enc(r[_after_nth(r, eot, n_eot):])
        ids += seg
        mask += [0] * len(seg)
        if m.get("token_ids") is not None:
            a = list(m["token_ids"])
        else:
            full = render(messages[:i + 1], tools, tokenizer, False)
            assert full.startswith(r), "chat template: the generation prompt is not a prefix of the turn"
            k = full.find(eot, len(r))
            assert k >= 0, f"chat template did not end the assistant turn with {eot!r}"
            a = enc(full[len(r):k + len(eot)])
        ids += a
        mask += [1] * len(a)
        if not a or a[-1] != eot_id:      # cut by the token limit: close the turn, not trained on
            ids.append(eot_id)
            mask.append(0)
        n_eot = r.count(eot) + 1
        if cache is not None:
            cache.update(tok=id(tokenizer), tools=tools, prefix=messages[:i + 1], ids=list(ids), mask=list(mask),
                         n_eot=n_eot)
    if messages and (messages[-1]["role"] != "assistant" or add_generation_prompt):
        r = render(messages, tools, tokenizer, add_generation_prompt)
        seg = enc(r[_after_nth(r, eot, n_eot):])
        ids += seg
        mask += [0] * len(seg)
    return ids, mask


def flat_logprobs(mask: list[int], per_turn: list[list[float] | None]) -> list[float]:
    """Spread per-turn sampled log-probs over the flat ids: the k-th run of mask==1 is the k-th turn that
    sampled a token (a turn of 0 tokens leaves no run in the mask)."""
    per_turn = [lp for lp in per_turn if lp is None or len(lp) > 0]
    out, k, i = [0.0] * len(mask), 0, 0
    while i < len(mask):
        if mask[i] == 0:
            i += 1
            continue
        j = i
        while j < len(mask) and mask[j] == 1:
            j += 1
        assert k < len(per_turn), "more policy segments than assistant turns"
        lp = per_turn[k]
        if lp is not None:
            assert len(lp) == j - i, f"turn {k}: {len(lp)} log-probs for {j - i} policy tokens"
            out[i:j] = lp
        k, i = k + 1, j
    return out


# --------------------------------------------------------------------------------------------------
# One episode
# --------------------------------------------------------------------------------------------------


@dataclass
class EnvConfig:
    max_turns: int = 150
    """turn limit (paper: 150 in training, 200 in evaluation)"""
    max_context_tokens: int = 131072
    """token budget of an episode (paper: 128k agentic); a turn samples at most what the prompt leaves of it"""
    single_turn: bool = False
    """no tools: one response holding model_new.py and kernels in fenced blocks (the warm-up stage)"""
    work_dir: str = "runs/workspaces"
    """parent directory of the per-episode workspaces"""
    workspace: str = "ctypes"
    """workspace form (tools.LAYOUTS): ctypes (kernels loaded through ctypes) | cuda_extension (the paper's)"""
    reward: str = "milestone"
    """reward kind of every verdict (reward.py): "milestone" (Eq. 1) | "speedup" (ablation)"""
    bash_timeout_s: float = 60.0
    """default and maximum time limit of one bash call, seconds"""
    max_obs_chars: int = 6000
    """observations longer than this are cut (head and tail kept)"""
    tool_workers: int = 16
    """threads running episodes' tool calls concurrently"""
    overlap_turns: bool = True
    """streaming policies: sample an episode's next turn as soon as its tools finish; off: all turn by turn"""
    final_check: bool = True
    """profile the final workspace at the end of each episode"""
    ncu: bool = True
    """profile adds a short Nsight Compute kernel summary when device is cuda and `ncu` is on PATH"""


class UsageError(ValueError):
    """Bad arguments, found before any work: the commands print str(e), one line naming the flag, and exit 2."""


def resolve_device(device: str) -> str:
    """Every command's `--sandbox.device`: "auto" -> "cuda" when torch lists a GPU, else "cpu"; "cpu" and
    "cuda" pass through. UsageError for anything else."""
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--sandbox.device must be auto | cpu | cuda, got {device!r}")
    if device != "auto":
        return device
    import torch   # here, not at the top: the environment itself never touches a GPU
    return "cuda" if torch.cuda.is_available() else "cpu"


def sized_env(max_turns_gpu: int = 150) -> EnvConfig:
    """An episode budget for this machine (the default of solve and kernelbench_eval's agent mode): the
    paper's turns with a GPU (150 in training and solve, 200 in evaluation); 20 turns and 32k tokens on a
    CPU-only machine, where every turn of a local model and every check is slow."""
    if resolve_device("auto") == "cuda":
        return EnvConfig(max_turns=max_turns_gpu)
    return EnvConfig(max_turns=20, max_context_tokens=32768)


class Episode:
    """One task's workspace, conversation and bookkeeping. step() applies one Action. The sandbox config
    `sb_cfg` sets the kernel backend (sb_cfg.device: cpu -> kernels/*.cpp, cuda -> kernels/*.cu)."""

    def __init__(self, eid: int, task: Task, cfg: EnvConfig, pool, sb_cfg: sandbox.SandboxConfig, log=None):
        assert isinstance(task, Task) and "class Model" in task.code, f"task {eid} has no source with class Model"
        self.id, self.cfg, self.pool, self.sb, self.log = eid, cfg, pool, sb_cfg, log or (lambda *a: None)
        self.src, self.name = task.code, task.name
        if cfg.workspace not in tools.LAYOUTS:
            raise UsageError(f"--env.workspace must be {' | '.join(tools.LAYOUTS)}, got {cfg.workspace!r}")
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.name)[:60]
        self.ws = tools.make_workspace(os.path.abspath(os.path.join(cfg.work_dir, f"ep{eid:05d}_{safe}")), self.src,
                                       sb_cfg.device, tol=max(sb_cfg.atol, sb_cfg.rtol), layout=cfg.workspace)
        self.hide = [tools.REPO, os.path.expanduser(sb_cfg.cache_dir), os.path.abspath(cfg.work_dir)]
        self.tools = None if cfg.single_turn else copy.deepcopy(tools.TOOLS)
        ext = "cu" if sb_cfg.device == "cuda" else "cpp"
        intro = open(os.path.join(self.ws, "INSTRUCTIONS.md")).read()
        if cfg.single_turn:      # no tools: drop their section, ask for the whole answer in fenced blocks
            fmt = f"single_turn_format{'_cuda_extension' if cfg.workspace == 'cuda_extension' else ''}.md"
            intro = intro.split("## Tools")[0] + tools.prompt(fmt).replace("{ext}", ext) + "\n"
        user = f"{intro}\n## model.py\n```python\n{self.src}\n```\n"
        system = tools.prompt("system_single.md" if cfg.single_turn else "system.md")
        self.messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        self.turns, self.turn_logprobs, self.seen = [], [], set()
        self.cache: dict[tuple[str, bool], dict] = {}   # (files digest, profiled) -> verdict dict
        self.best_verdict, self.best_reward, self.best_files = None, -1.0, {}
        self.final_verdict, self.final_reward = None, -1.0
        self.invalid_calls = self.repeated_calls = 0
        self.n_context, self.done, self.stop_reason = 0, False, ""
        self.tok_cache: dict = {}     # shared with the policy through EpisodeState.cache

    def state(self) -> EpisodeState:
        return EpisodeState(self.id, self.messages, self.tools, self.tok_cache, self.cfg.max_context_tokens)

    # ---- verdicts ------------------------------------------------------------------------------
    def check(self, profile: bool) -> dict:
        """The sandbox's verdict on the workspace (cached by content), with the reward kept by reward.py.
        A workspace the host refuses to read (a link or FIFO) is not cached: the sandbox refuses it too and
        returns a failing verdict with the reason."""
        try:
            files = tools.snapshot(self.ws)
            key = hashlib.sha1(json.dumps(files, sort_keys=True).encode()).hexdigest()
        except WorkspaceError:
            files, key = {}, None
        if key is not None and ((key, True) in self.cache or (key, profile) in self.cache):
            return self.cache.get((key, True)) or self.cache[(key, profile)]
        cfg = dataclasses.replace(self.sb, profile=profile)
        # the pristine task source (str), never ws/model.py; the workspace as a location (Path)
        v = self.pool.submit(self.src, pathlib.Path(self.ws), cfg).result().to_dict()
        if key is not None:
            self.cache[(key, profile)] = v
        r = reward.reward_from_verdict(v, self.cfg.reward)
        # best = highest reward, then fastest (a timed verdict beats an untimed one of the same tier)
        old_ms = (self.best_verdict or {}).get("candidate_ms")
        faster = v.get("candidate_ms") is not None and (old_ms is None or v["candidate_ms"] < old_ms)
        if r > self.best_reward or (r == self.best_reward and faster) or self.best_verdict is None:
            self.best_verdict, self.best_reward, self.best_files = v, r, files
        return v

    # ---- tools -----------------------------------------------------------------------------------
    def call(self, name: str, args: dict) -> tuple[str, dict | None]:
        """Run one tool. Returns (observation, verdict or None). Tool errors come back as text."""
        ws, cfg = self.ws, self.cfg
        if name == "bash":
            t = min(float(args.get("timeout") or cfg.bash_timeout_s), cfg.bash_timeout_s)
            return tools.run_bash(ws, args["command"], t, self.hide, self.sb.device, cfg.max_obs_chars), None
        if name == "read_file":
            return tools.read_file(ws, args["path"], args.get("offset"), args.get("limit"), cfg.max_obs_chars), None
        if name == "write_file":
            return tools.write_file(ws, args["path"], args["content"]), None
        if name == "edit_file":
            return tools.edit_file(ws, args["path"], args["old_str"], args["new_str"]), None
        if name == "glob":
            return tools.glob(ws, args["pattern"]), None
        if name == "grep":
            return tools.grep(ws, args["pattern"], args.get("glob"), cfg.max_obs_chars), None
        if name == "compile":
            ok, log, libs = self.pool.compile(ws).result()
            head = f"compiled OK: {', '.join(sorted(libs)) or '(no kernels)'}" if ok else "compile FAILED"
            return tools.truncate(head + ("\n" + log.strip() if log.strip() else ""), cfg.max_obs_chars), None
        if name in ("verify", "profile"):
            v = self.check(profile=name == "profile")
            txt = tools.profile_text(v, reward.reward_from_verdict(v, cfg.reward)) if name == "profile" \
                else tools.verify_text(v)
            if name == "profile" and v.get("correct") and cfg.ncu and self.sb.device == "cuda" and shutil.which("ncu"):
                txt += "\n" + self._ncu_summary()
            return tools.truncate(txt, cfg.max_obs_chars), v
        assert name == "finish", name
        self.done, self.stop_reason = True, "finish"
        return "episode finished", None

    def _ncu_summary(self) -> str:
        """One forward of ModelNew under `ncu --print-summary per-kernel`, isolated like bash."""
        ok, log, libs = self.pool.compile(self.ws).result()
        if not ok:
            return "ncu: kernels do not compile"
        d = os.path.join(self.ws, ".ncu")        # dot-dir: not part of snapshots
        os.makedirs(d, exist_ok=True)
        local = {n: shutil.copy(so, os.path.join(d, f"{n}.so")) for n, so in libs.items()}
        with open(os.path.join(d, "run.py"), "w") as f:
            f.write(tools.prompt("ncu_driver.py"))
        # PYTHONPATH=.: `python .ncu/run.py` puts .ncu/, not the workspace, first on sys.path
        cmd = (f"HOME=$PWD/.ncu PYTHONPATH=.:${{PYTHONPATH:-}} CUDA_AGENT_KERNELS='{json.dumps(local)}' "
               f"ncu --print-summary per-kernel --launch-count 50 "
               f"python .ncu/run.py 2>&1 | grep -v '^==PROF==' | tail -n 60")
        return "ncu kernel summary (one forward):\n" + tools.run_bash(self.ws, cmd, 180, self.hide, "cuda", 2500)

    # ---- one turn --------------------------------------------------------------------------------
    def step(self, a: Action) -> None:
        """Append the assistant turn and its observations; update counters and the stop condition. A "context"
        action (no room left under the token budget, nothing sampled) is no turn: the episode stops."""
        if a.finish_reason == "context":
            self.done, self.stop_reason = True, "context"
            return
        self.messages.append(a.message())
        first_obs = len(self.messages)
        self.turn_logprobs.append(a.logprobs)
        self.log(self.id, "assistant", a.text)
        meta = {"turn": len(self.turns), "finish_reason": a.finish_reason, "n_context": a.n_context,
                "calls": [], "errors": list(a.errors)}
        self.turns.append(meta)
        if self.cfg.single_turn:
            return self._single_turn(a)
        self.invalid_calls += len(a.errors)
        for tc in a.tool_calls:
            if self.done:
                break                              # nothing runs after finish
            obs, rec = self._run_call(tc)
            meta["calls"].append(rec)
            self.messages.append({"role": "tool", "tool_call_id": tc["id"], "name": rec["name"], "content": obs})
            self.log(self.id, "tool", f"{rec['name']}({rec['args_text'][:200]}) -> {obs}")
        notes = list(a.errors)
        if not a.tool_calls and not a.errors:
            notes.append("no tool call found: call a tool (write_file, compile, verify, profile, ...) or finish")
        if a.finish_reason == "length":
            notes.append("your turn was cut at the token limit")
        if notes and not self.done:
            self.messages.append({"role": "user", "content": "\n".join(f"[error] {n}" for n in notes)})
            self.log(self.id, "error", "; ".join(notes))
        # token budget, for policies that do not hold it before a turn themselves (policy.HFPolicy does): what the
        # policy reported, plus a rough count of the new observations (~3.5 chars/token)
        obs_chars = sum(len(m.get("content") or "") for m in self.messages[first_obs:])
        self.n_context = max(self.n_context, a.n_context or 0) + int(obs_chars / 3.5)
        if not self.done and len(self.turns) >= self.cfg.max_turns:
            self.done, self.stop_reason = True, "max_turns"
        if not self.done and self.n_context >= self.cfg.max_context_tokens:
            self.done, self.stop_reason = True, "context"

    def _run_call(self, tc: dict) -> tuple[str, dict]:
        f = tc.get("function", {})
        name, args_text = f.get("name", ""), f.get("arguments", "{}")
        rec = {"name": name, "args_text": args_text, "duration_s": 0.0, "verdict": None, "error": None}
        try:
            args = json.loads(args_text) if isinstance(args_text, str) else args_text
        except json.JSONDecodeError as e:
            args, rec["error"] = None, f"arguments are not valid JSON: {e}"
        key = (name, json.dumps(args, sort_keys=True) if args is not None else args_text)
        self.repeated_calls += key in self.seen       # RFT drops loops (paper §3.3 stage 2)
        self.seen.add(key)
        if rec["error"] is None:
            rec["error"] = tools.check_args(name, args)
        if rec["error"] is not None:
            self.invalid_calls += 1
            return f"error: {rec['error']}", rec
        t0 = time.time()
        try:
            obs, rec["verdict"] = self.call(name, args)
        except ValueError as e:        # confinement, links and special files (WorkspaceError), bad values
            obs = f"error: {e}"
        except sandbox.SandboxError:   # the sandbox's own failure (a lost node): it stops the run, never a -1
            raise
        except Exception as e:         # a tool must never take the episode down
            obs = f"error: internal tool failure: {type(e).__name__}: {str(e)[:300]}"
        rec["duration_s"] = round(time.time() - t0, 3)
        return obs, rec

    def _single_turn(self, a: Action) -> None:
        files, errors = tools.parse_solution_blocks(a.content if a.tool_calls else a.text)
        self.invalid_calls += len(errors) if "model_new.py" not in files else 0
        tools.write_files(self.ws, files)
        self.turns[-1]["errors"] += errors
        self.done, self.stop_reason = True, "single_turn"

    def close(self) -> None:
        """Final check of the workspace as left (profiled, cached if unchanged)."""
        if self.cfg.final_check or self.cfg.single_turn:
            try:
                self.final_verdict = self.check(profile=self.sb.profile)
                self.final_reward = reward.reward_from_verdict(self.final_verdict, self.cfg.reward)
            except sandbox.SandboxError:  # not the candidate's doing (a lost node): it stops the run, never a -1
                raise
            except Exception as e:   # the sandbox promises verdicts; keep the episode even if it breaks
                self.final_verdict = {"error": f"final check failed: {type(e).__name__}: {e}"}
            self.log(self.id, "verdict", tools.profile_text(self.final_verdict, self.final_reward)
                     if "compiled" in self.final_verdict else self.final_verdict["error"])

    def trajectory(self, tokenizer=None) -> Trajectory:
        """The episode's record. With a tokenizer: ids, mask and log-probs too, and observations after the last
        turn that would take the record past the token budget are left out of it (no turn read them; the last
        turn's calls keep their verdicts, and `observations_dropped` counts them)."""
        msgs, record = self.messages, None
        if tokenizer is not None:
            record = tokenize_conversation(msgs, self.tools, tokenizer, cache=self.tok_cache)   # (ids, mask)
            last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=len(msgs) - 1)
            if len(record[0]) > self.cfg.max_context_tokens and last < len(msgs) - 1:
                self.turns[-1]["observations_dropped"] = len(msgs) - 1 - last
                msgs = msgs[:last + 1]
                record = tokenize_conversation(msgs, self.tools, tokenizer, cache=self.tok_cache)
        t = Trajectory(task=self.name, task_source=self.src, messages=msgs, tools=self.tools,
                       turns=self.turns, final_verdict=self.final_verdict, final_reward=self.final_reward,
                       best_verdict=self.best_verdict, best_reward=self.best_reward, best_files=self.best_files,
                       invalid_calls=self.invalid_calls, repeated_calls=self.repeated_calls,
                       stop_reason=self.stop_reason)
        if record is not None:
            t.ids, t.mask = record
            t.logprobs = flat_logprobs(t.mask, self.turn_logprobs)
        return t


def _advance(e: Episode, a: Action) -> None:
    e.step(a)
    if e.done:
        e.close()      # the final check starts now, overlapping the other episodes' turns


def run_episodes(policy: Policy, tasks: list[Task], pool, cfg: EnvConfig, tokenizer=None, log=None,
                 id_offset: int = 0) -> list[Trajectory]:
    """Run one episode per task; their tools run concurrently. A policy that streams samples each episode's next
    turn as soon as its tools finish (`cfg.overlap_turns`); otherwise all active episodes act together.
    pool: a sandbox.SandboxPool; its config is every check's (None: no checks, e.g. final_check off).
    tokenizer: for ids/mask/logprobs in the records (default: policy.tok if the policy has one)."""
    sb = getattr(pool, "cfg", None) or sandbox.SandboxConfig()
    tok = tokenizer if tokenizer is not None else getattr(policy, "tok", None)
    eps = [Episode(id_offset + i, t, cfg, pool, sb, log) for i, t in enumerate(tasks)]
    with concurrent.futures.ThreadPoolExecutor(max(1, cfg.tool_workers)) as ex:
        if cfg.overlap_turns and getattr(policy, "streams", False):
            by_id = {e.id: e for e in eps}

            def after(e: Episode, a: Action) -> EpisodeState | None:    # on the pool: the tools, the next state
                _advance(e, a)
                return None if e.done else e.state()

            policy.stream([e.state() for e in eps], lambda eid, a: ex.submit(after, by_id[eid], a))
        else:
            active = list(eps)
            while active:
                actions = policy.act([e.state() for e in active])     # one batched generate per turn
                assert len(actions) == len(active), f"policy returned {len(actions)} actions for {len(active)} episodes"
                list(ex.map(_advance, active, actions))               # tools (and final checks) run concurrently
                for e in active:
                    if e.done and hasattr(policy, "release"):
                        policy.release(e.id)                          # optional: free the episode's KV cache
                active = [e for e in active if not e.done]
    return [e.trajectory(tok) for e in eps]
