"""Policies that drive the agent loop: a local transformers model, an OpenAI-compatible endpoint, replay; the
tool-call parser; the tiny MoE + local tokenizer for tests; the real checkpoint loader.

  * A policy is any object with `act(states: list[EpisodeState]) -> list[Action]` (env.py defines both),
    called once per turn on all active episodes, and optionally `release(episode_id)`.
  * HFPolicy (what training uses): prompts are env.tokenize_conversation(..., add_generation_prompt=True),
    so every prompt extends the previous one plus what was sampled: the record re-tokenises exactly, and a
    KV cache can be carried across turns (`engine=`, engine.Engine). With the engine, `stream` overlaps
    turns: an episode's next turn is sampled as soon as its tools finish, while the others decode (what
    env.run_episodes uses). Without an engine: one batched `model.generate` per turn. Either way a turn
    samples at most what the episode's token budget (EpisodeState.max_context_tokens) leaves after its
    prompt (`turn_budget`).
  * OpenAIPolicy: any /v1/chat/completions endpoint over urllib, with tool schemas, retries and backoff.
  * ReplayPolicy: plays back scripted or recorded assistant messages (tests, demos).
  * parse_tool_calls: JSON inside <tool_call> (Qwen3) and <function=NAME><parameter=K> (Qwen3-Coder).
  * build_tiny_model_and_tokenizer(): a random ~1.5M-parameter Qwen3-MoE and a BPE tokenizer trained on a
    fixed in-file corpus plus the shipped data/ (prompts, tool schemas, tiny tasks, demos), with the chat
    template of data/prompts/tiny_chat_template.jinja. No downloads.

Departures from the paper
  1. The paper's rollout engine is not published; we sample with the training-side model itself
     (`model.generate`, or engine.Engine). PPO recomputes the old log-probs on the training side; the
     sampler's own (Action.logprobs, at temperature 1) measure the gap between the two (ppo.sampler_gap).
  2. The tiny tokenizer is trained on a small corpus of this project's own text, without word splitting, so
     its tokens are long domain phrases: the tiny model exists for tests and smoke runs.

Smoke: python -m pytest -q tests/test_policy.py
Full:  python cuda_agent.py solve TASK --policy openai --model NAME --endpoint http://host:8000/v1
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import torch
from peft import PeftModel
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

import tools
from engine import Engine
from env import Action, EpisodeState, end_of_turn, resolve_device, tokenize_conversation

# --------------------------------------------------------------------------------------------------
# Tool-call parsing
# --------------------------------------------------------------------------------------------------

_BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)
_FUNC = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _param_types(tools: list[dict] | None) -> dict[str, dict[str, str]]:
    out = {}
    for t in tools or []:
        f = t.get("function", t)
        out[f.get("name", "")] = {k: v.get("type", "string")
                                  for k, v in f.get("parameters", {}).get("properties", {}).items()}
    return out


def _parse_xml_call(body: str, types: dict) -> dict:
    """Qwen3-Coder: <function=NAME><parameter=K>\nV\n</parameter>...</function>."""
    m = _FUNC.search(body)
    if not m:
        raise ValueError("no <function=NAME> inside <tool_call>")
    name, args = m.group(1).strip(), {}
    for k, v in _PARAM.findall(m.group(2)):
        v = v[1:] if v.startswith("\n") else v
        v = v[:-1] if v.endswith("\n") else v
        if types.get(name, {}).get(k.strip(), "string") != "string":
            try:
                v = json.loads(v)
            except json.JSONDecodeError:
                pass  # keep the string; the env validates argument types
        args[k.strip()] = v
    return {"name": name, "arguments": args}


def _parse_json_call(body: str) -> dict:
    """Qwen2.5/Qwen3: {"name": ..., "arguments": {...}}; trailing text after the object is ignored."""
    start = body.find("{")
    if start < 0:
        raise ValueError("no JSON object inside <tool_call>")
    obj, _ = json.JSONDecoder().raw_decode(body[start:])
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError('tool call JSON needs a string "name"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError('tool call "arguments" must be a JSON object')
    return {"name": obj["name"], "arguments": args}


def parse_tool_calls(text: str, tools: list[dict] | None = None, id_prefix: str = "call"
                     ) -> tuple[str, list[dict], list[str]]:
    """Split assistant text into (content, tool_calls, errors). Never raises.

    content keeps everything except well-formed call blocks; tool_calls are OpenAI-format dicts.
    """
    types, calls, errors, content, pos = _param_types(tools), [], [], [], 0
    for m in _BLOCK.finditer(text):
        body, closed = m.group(1), bool(m.group(2))
        try:
            if not closed:
                raise ValueError("unterminated <tool_call> (missing </tool_call>)")
            call = _parse_xml_call(body, types) if "<function=" in body else _parse_json_call(body)
            content.append(text[pos:m.start()])
            calls.append({"id": f"{id_prefix}_{len(calls)}", "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}})
        except (ValueError, json.JSONDecodeError) as e:
            content.append(text[pos:m.end()])
            errors.append(f"malformed tool call: {str(e).splitlines()[0][:200]}")
        pos = m.end()
    content.append(text[pos:])
    stray = text.count("</tool_call>") - sum(1 for m in _BLOCK.finditer(text) if m.group(2))
    if stray > 0:
        errors.append("malformed tool call: </tool_call> without a matching <tool_call>")
    return "".join(content).strip(), calls, errors


# --------------------------------------------------------------------------------------------------
# Tiny model + local tokenizer (tests, smoke runs) and the real loader
# --------------------------------------------------------------------------------------------------

# A Qwen3-style tool template (our own wording), data/prompts/tiny_chat_template.jinja. Tool calls are JSON
# in <tool_call> blocks; tool results go back in a user turn inside <tool_response> blocks.


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


# A fixed corpus (not the repo's files, which change from commit to commit): the tiny tokenizer, and so
# every recorded token id, is the same on every machine and at every commit.
TINY_CORPUS = [
    'import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self, dim):\n'
    '        super().__init__()\n        self.linear = nn.Linear(dim, dim)\n\n    def forward(self, x):\n'
    '        return torch.relu(self.linear(x)) * 2.0 + 1.0\n\n\ndef get_inputs():\n'
    '    return [torch.randn(128, 512)]\n\n\ndef get_init_inputs():\n    return [512]\n',
    'import ctypes\n\nimport torch\nimport torch.nn as nn\nfrom sandbox_worker import load_kernel, ptr, stream\n\n'
    'lib = load_kernel("relu")\nlib.relu_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, '
    'ctypes.c_void_p]\n\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n'
    '        y = torch.empty_like(x)\n        lib.relu_forward(ptr(x), ptr(y), x.numel(), stream())\n'
    '        return y\n',
    'extern "C" void relu_forward(const float* x, float* y, long n, void* stream) {\n#pragma omp parallel for\n'
    '    for (long i = 0; i < n; ++i) y[i] = x[i] > 0.f ? x[i] : 0.f;\n}\n',
    '#include <cuda_runtime.h>\n\n__global__ void scale_kernel(const float* __restrict__ x, float* __restrict__ y, '
    'long n) {\n    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < n) y[i] = x[i] * 2.0f + 1.0f;\n'
    '}\n\nextern "C" void scale(const float* x, float* y, long n, void* stream) {\n    int threads = 256;\n'
    '    int blocks = (int)((n + threads - 1) / threads);\n    scale_kernel<<<blocks, threads, 0, '
    '(cudaStream_t)stream>>>(x, y, n);\n}\n',
    '<tool_call>\n{"name": "write_file", "arguments": {"path": "kernels/relu.cu", "content": "..."}}\n</tool_call>\n'
    '<tool_call>\n{"name": "compile", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "verify", '
    '"arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "profile", "arguments": {}}\n</tool_call>\n'
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls kernels"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "finish", "arguments": {}}\n</tool_call>\n',
    '<tool_response>\ncorrect: True (5/5 trials passed, precision tf32)\ndevice NVIDIA H200: eager 1.20 ms | '
    'torch.compile 0.95 ms | ModelNew 0.41 ms\nspeedup vs eager 2.9x, vs torch.compile 2.3x\n</tool_response>\n',
    'The kernel reads the input once, writes the output once, and keeps the arithmetic in registers. '
    'First I will read model.py and the instructions, then write the kernel, compile it, verify the '
    'results against the reference, and profile it against eager PyTorch and torch.compile.\n',
    tools.prompt("tiny_chat_template.jinja"),
]


def tiny_domain_corpus() -> list[str]:
    """What the tiny model reads and writes, from the shipped data/: the prompts, the tool schemas, the tiny
    tasks and their demonstrations (also JSON-escaped, as write_file arguments carry them). A tokenizer trained
    on it spells a demonstration's files in 20-50 tokens instead of 590-720 (single-turn, agentic), which is
    what lets the tiny model learn to reproduce one. Sorted: the same data/ gives the same ids everywhere."""
    data = os.path.join(tools.REPO, "data")
    texts = [tools.prompt(n) for n in ("system.md", "system_single.md", "single_turn_format.md", "instructions.md")]
    texts += [json.dumps(t, ensure_ascii=False) for t in tools.TOOLS]   # as the template's tojson renders them
    path = os.path.join(data, "tasks_tiny.jsonl")
    if os.path.isfile(path):
        with open(path) as f:
            texts += [json.loads(line)["code"] for line in f if line.strip()]
    demos = []
    for root, _, names in sorted(os.walk(os.path.join(data, "demos"))):
        for n in sorted(names):
            if n.endswith((".py", ".cpp", ".cu")):
                with open(os.path.join(root, n)) as f:
                    demos.append(f.read())
    return texts + demos + [json.dumps(d) for d in demos]


def build_tiny_tokenizer(vocab_size: int = 4096, corpus: list[str] | None = None):
    """Byte-level BPE trained on TINY_CORPUS and `tiny_domain_corpus()` (< 1 s), as a PreTrainedTokenizerFast.
    No pre-tokenizer split (use_regex=False): merges cross words and lines, so tokens become whole phrases."""
    corpus = corpus if corpus is not None else TINY_CORPUS * 4 + tiny_domain_corpus()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + TOOL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=SPECIAL_TOKENS[1:] + TOOL_TOKENS)
    hf.chat_template = tools.prompt("tiny_chat_template.jinja")
    for t in SPECIAL_TOKENS + TOOL_TOKENS:
        assert len(hf.encode(t, add_special_tokens=False)) == 1, f"{t} must be a single token"
    return hf


def build_tiny_model_and_tokenizer(seed: int = 0, vocab_size: int = 4096, hidden_size: int = 128,
                                   num_layers: int = 2, num_experts: int = 4, top_k: int = 2,
                                   max_positions: int = 8192, head_std: float = 0.2):
    """A random Qwen3-MoE (about 1.5M params at the defaults) and a local tokenizer. Returns (model, tok).

    head_std: init std of the output head. LoRA never trains the head or the final norm, so the head's scale
    caps every logit: at the usual 0.02, with an RMS-normed hidden state of norm ~sqrt(hidden_size), no logit
    exceeds ~0.02 * hidden_size = 2.6 and no token gets more than ~1% of the mass over thousands of tokens:
    the adapters could not make the model reproduce anything. 0.2 allows logits of ~25."""
    tok = build_tiny_tokenizer(vocab_size)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         moe_intermediate_size=hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
                         num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                         max_position_embeddings=max_positions, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, head_std)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


ADAPTER_META = "cuda_agent.json"  # written by `train` into OUT/adapter/: the base model the adapter belongs to


def adapter_base(adapter: str) -> str | None:
    """The base model of an adapter folder written by `train` (OUT/adapter/cuda_agent.json): a hub id or path,
    or the folder's own base/ (the tiny preset's random base, saved beside it). None: not such a folder."""
    path = os.path.join(adapter, ADAPTER_META)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        base = json.load(f)["base_model"]
    local = os.path.join(adapter, base)
    return local if os.path.isdir(local) else base


def load_policy_model(name_or_path: str, adapter: str | None = None, dtype: str = "bfloat16",
                      device: str = "cuda", trainable_adapter: bool = False):
    """A real checkpoint (local dir or hub id already in the cache) + optional peft adapter. (model, tok)."""
    tok = AutoTokenizer.from_pretrained(name_or_path)
    assert tok.chat_template, f"{name_or_path} has no chat template; tools need one"
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=getattr(torch, dtype), device_map=device)
    if adapter:
        model = PeftModel.from_pretrained(model, adapter, is_trainable=trainable_adapter)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok


# --------------------------------------------------------------------------------------------------
# (a) local transformers policy
# --------------------------------------------------------------------------------------------------


class HFPolicy:
    """Batched sampling from a local causal LM, one batched call per turn over all active episodes.

    Plain path: `model.generate` on the left-padded prompts (re-encodes each conversation every turn).
    engine: an engine.Engine (or any object with its `step_full` / `release`): the prompts go to
    `engine.step_full([(episode_id, prompt_ids)])`, which feeds only the tokens after what the episode
    already has in its KV cache and keeps the batch full. Prompts are built the same way on
    both paths (tokenize_conversation), so the records are identical in format.
    """

    def __init__(self, model, tokenizer, max_new_tokens: int = 1024, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, engine=None, max_batch: int = 64,
                 kv_budget_gib: float | None = None, experts: str | None = None):
        self.model, self.tok = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.seed, self.calls = seed, 0
        self._turns: dict[int, int] = {}        # turns sampled per episode (numbers its tool-call ids)
        self.eot_id = tokenizer.convert_tokens_to_ids(end_of_turn(tokenizer))
        if engine is True:  # build the KV-cache-reusing engine for this model (make a new policy per update)
            engine = Engine(model, tokenizer, max_batch=max_batch, max_new_tokens=max_new_tokens,
                                     temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                     stop_ids={self.eot_id}, cuda_graphs=next(model.parameters()).is_cuda,
                                     kv_budget_gib=kv_budget_gib, experts=experts)
        self.engine = engine or None
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eot_id

    def prompt_ids(self, s: EpisodeState) -> list[int]:
        return tokenize_conversation(s.messages, s.tools, self.tok, add_generation_prompt=True, cache=s.cache)[0]

    def turn_budget(self, s: EpisodeState, prompt: list[int]) -> int:
        """Tokens this turn may sample: max_new_tokens, and no more than the episode's token budget leaves after
        the prompt and the end-of-turn token that closes a cut turn (env.tokenize_conversation appends it), so
        the record stays within the budget. <= 0: no room, the turn is not sampled ("context")."""
        if s.max_context_tokens is None:
            return self.max_new_tokens
        return min(self.max_new_tokens, s.max_context_tokens - len(prompt) - 1)

    def release(self, episode_id: int) -> None:
        """The episode ended: free its KV cache (engine path). env.run_episodes calls this."""
        self._turns.pop(episode_id, None)
        if self.engine is not None:
            self.engine.release(episode_id)

    def _sample_plain(self, prompts: list[list[int]], budgets: list[int]) -> list[tuple[list[int], list[float], str]]:
        """One batched `model.generate` over the prompts with room left; each row is cut at its own budget."""
        res: list = [([], [], "context")] * len(prompts)
        todo = [i for i, b in enumerate(budgets) if b > 0]
        if todo:
            for i, r in zip(todo, self._generate([prompts[i] for i in todo], max(budgets[i] for i in todo))):
                ids, lps, reason = r
                if len(ids) > budgets[i]:                        # past this row's budget: cut, as "length"
                    ids, lps, reason = ids[:budgets[i]], lps[:budgets[i]], "length"
                res[i] = (ids, lps, reason)
        return res

    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], list[float], str]]:
        dev = next(self.model.parameters()).device
        L = max(map(len, prompts))
        inp = torch.tensor([[self.pad_id] * (L - len(p)) + p for p in prompts], device=dev)   # (B, L) left-padded
        att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=dev)  # (B, L)
        torch.manual_seed(self.seed + self.calls)   # reproducible sampling, one seed per turn
        with torch.no_grad():
            out = self.model.generate(input_ids=inp, attention_mask=att, do_sample=self.temperature > 0,
                                      temperature=self.temperature or None, top_p=self.top_p,
                                      top_k=self.top_k, max_new_tokens=max_new_tokens,
                                      eos_token_id=self.eot_id, pad_token_id=self.pad_id,
                                      return_dict_in_generate=True, output_logits=True)
        gen = out.sequences[:, L:]                                                  # (B, T)
        logits = torch.stack(out.logits, dim=1).float()                             # (B, T, V) unprocessed
        lp = torch.log_softmax(logits, dim=-1)          # at temperature 1, unfiltered: as engine.Engine's
        lp = lp.gather(-1, gen.unsqueeze(-1)).squeeze(-1)                           # (B, T)
        res = []
        for b in range(len(prompts)):
            row = gen[b].tolist()
            n = row.index(self.eot_id) + 1 if self.eot_id in row else len(row)
            res.append((row[:n], lp[b, :n].tolist(), "stop" if self.eot_id in row else "length"))
        return res

    def act(self, states: list[EpisodeState]) -> list[Action]:
        if not states:
            return []
        prompts = [self.prompt_ids(s) for s in states]
        budgets = [self.turn_budget(s, p) for s, p in zip(states, prompts)]
        if self.engine is not None:   # a budget <= 0 comes back at once as a "context" result with no tokens
            out = self.engine.step_full([(s.episode_id, p, b) for s, p, b in zip(states, prompts, budgets)])
            res = [(ids, lps, reason) for _, ids, lps, reason in out]
        else:
            res = self._sample_plain(prompts, budgets)
        self.calls += 1
        return [self._action(s, p, *r) for s, p, r in zip(states, prompts, res)]

    @property
    def streams(self) -> bool:
        """Whether `stream` can run (the engine path)."""
        return self.engine is not None

    def stream(self, states: list[EpisodeState], advance) -> None:
        """Turns overlap across episodes (engine path): each episode's action goes to `advance(episode_id, action)`
        as soon as its row finishes; advance returns a Future of the episode's next state (None once it ended),
        and while it runs (the tools) the other rows decode on; when it resolves, the episode's next turn joins
        the batch (engine.Engine.step_full with follow). The actions and log-probs equal `act`'s turn by turn."""
        by_id = {s.episode_id: s for s in states}
        prompts = {s.episode_id: self.prompt_ids(s) for s in states}

        def follow(res):
            eid, ids, lps, reason = res
            nxt = concurrent.futures.Future()

            def ready(f):                       # on the thread that ran advance: the next prompt, tokenized
                try:
                    s = f.result()
                    if s is not None:
                        by_id[eid], prompts[eid] = s, self.prompt_ids(s)
                    nxt.set_result(None if s is None else (prompts[eid], self.turn_budget(s, prompts[eid])))
                except BaseException as e:      # the engine re-raises it
                    nxt.set_exception(e)

            advance(eid, self._action(by_id[eid], prompts[eid], ids, lps, reason)).add_done_callback(ready)
            return nxt

        self.engine.step_full([(eid, p, self.turn_budget(by_id[eid], p)) for eid, p in prompts.items()],
                              follow=follow, release=True)
        for eid in prompts:
            self._turns.pop(eid, None)

    def _action(self, s: EpisodeState, prompt: list[int], ids: list[int], lps: list[float], reason: str) -> Action:
        """A sampled turn as an Action: text, parsed tool calls (ids numbered by the episode's turn), log-probs.
        "context": no room was left under the token budget, nothing was sampled."""
        if reason == "context":
            return Action(text="", token_ids=[], logprobs=[], finish_reason="context", n_context=len(prompt))
        reason = "stop" if reason == "stop" else "length"
        n = self._turns[s.episode_id] = self._turns.get(s.episode_id, 0) + 1
        text = self.tok.decode(ids[:-1] if reason == "stop" else ids, skip_special_tokens=False)
        content, calls, errs = parse_tool_calls(text, s.tools, id_prefix=f"call_{s.episode_id}_{n}")
        return Action(text=text, content=content, tool_calls=calls, errors=errs, token_ids=list(ids),
                      logprobs=list(lps), finish_reason=reason, n_context=len(prompt) + len(ids))


# --------------------------------------------------------------------------------------------------
# (b) OpenAI-compatible endpoint
# --------------------------------------------------------------------------------------------------


class OpenAIPolicy:
    """POST {endpoint}/chat/completions with the tool schemas; parses `tool_calls` (or inline markup)."""

    def __init__(self, model: str, endpoint: str = "http://127.0.0.1:8000/v1", api_key_env: str = "OPENAI_API_KEY",
                 max_tokens: int = 4096, temperature: float = 0.7, retries: int = 4, backoff_s: float = 1.0,
                 timeout_s: float = 600, concurrency: int = 16):
        self.model, self.url = model, endpoint.rstrip("/") + "/chat/completions"
        self.api_key = os.environ.get(api_key_env, "")
        self.max_tokens, self.temperature = max_tokens, temperature
        self.retries, self.backoff_s, self.timeout_s, self.concurrency = retries, backoff_s, timeout_s, concurrency

    def _post(self, body: dict) -> dict:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        err = ""
        for attempt in range(self.retries + 1):
            try:
                req = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    return json.loads(r.read().decode())
            except urllib.error.HTTPError as e:
                err = f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
                if e.code not in (408, 409, 429) and e.code < 500:
                    break                   # a client error will not fix itself
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as e:
                err = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2 ** attempt)
        raise RuntimeError(f"chat endpoint {self.url} failed after {self.retries + 1} tries: {err}")

    @staticmethod
    def _clean(m: dict) -> dict:
        """Only the standard chat keys (endpoints reject unknown ones)."""
        return {k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id", "name")}

    def _one(self, s: EpisodeState) -> Action:
        body = {"model": self.model, "messages": [self._clean(m) for m in s.messages],
                "max_tokens": self.max_tokens, "temperature": self.temperature}
        if s.tools:
            body["tools"] = s.tools
        try:
            resp = self._post(body)
            choice = resp["choices"][0]
            msg = choice.get("message") or {}
        except (RuntimeError, KeyError, IndexError, TypeError) as e:
            # the episode sees the failure as an empty turn with an error; the run goes on
            return Action(text="", errors=[f"policy endpoint error: {str(e)[:300]}"], finish_reason="stop")
        text = msg.get("content") or ""
        calls, errors = [], []
        for i, tc in enumerate(msg.get("tool_calls") or []):
            f = tc.get("function", {})
            args = f.get("arguments", "{}")
            try:
                parsed = json.loads(args) if isinstance(args, str) else args
                assert isinstance(parsed, dict), "arguments must be a JSON object"
                calls.append({"id": tc.get("id") or f"call_{s.episode_id}_{i}", "type": "function",
                              "function": {"name": f.get("name", ""), "arguments": json.dumps(parsed)}})
            except (json.JSONDecodeError, AssertionError) as e:
                errors.append(f"malformed tool call arguments for {f.get('name')!r}: {e}")
        content = text
        if not calls and "<tool_call>" in text:   # server without a tool parser: parse the markup ourselves
            content, calls, errors = parse_tool_calls(text, s.tools, id_prefix=f"call_{s.episode_id}")
        usage = resp.get("usage") or {}
        return Action(text=text, content=content, tool_calls=calls, errors=errors,
                      finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
                      n_context=usage.get("total_tokens"))

    def act(self, states: list[EpisodeState]) -> list[Action]:
        with concurrent.futures.ThreadPoolExecutor(max(1, min(self.concurrency, len(states)))) as ex:
            return list(ex.map(self._one, states))


# --------------------------------------------------------------------------------------------------
# (c) replay
# --------------------------------------------------------------------------------------------------


def _action_from_message(m: dict, tools: list[dict] | None, tag: str) -> Action:
    """A scripted assistant message: {"content": str, "tool_calls": [...]} or raw text with markup."""
    text = m.get("content") or ""
    if m.get("tool_calls"):
        calls = [{"id": tc.get("id") or f"{tag}_{i}", "type": "function",
                  "function": {"name": tc["function"]["name"],
                               "arguments": tc["function"]["arguments"] if isinstance(tc["function"]["arguments"], str)
                               else json.dumps(tc["function"]["arguments"])}}
                 for i, tc in enumerate(m["tool_calls"])]
        return Action(text=text, content=text, tool_calls=calls, token_ids=m.get("token_ids"))
    content, calls, errors = parse_tool_calls(text, tools, id_prefix=tag)
    return Action(text=text, content=content, tool_calls=calls, errors=errors, token_ids=m.get("token_ids"))


class ReplayPolicy:
    """Plays back assistant messages: one script for every episode, or {episode_id: script}.

    A script is a list of assistant messages (dicts with "content" and optional "tool_calls", or plain
    strings holding tool-call markup), or a path to a trajectory JSONL (its first record's assistant
    messages). When a script runs out the policy calls `finish`, so episodes always end.
    """

    def __init__(self, script: list | dict | str):
        if isinstance(script, str):
            with open(script) as f:
                rec = json.loads(f.readline())
            script = [m for m in rec["messages"] if m["role"] == "assistant"]
        self.script = script
        self.turn: dict[int, int] = {}

    def act(self, states: list[EpisodeState]) -> list[Action]:
        out = []
        for s in states:
            seq = self.script[s.episode_id] if isinstance(self.script, dict) else self.script
            i = self.turn.get(s.episode_id, 0)
            self.turn[s.episode_id] = i + 1
            tag = f"call_{s.episode_id}_{i}"
            if i >= len(seq):
                out.append(Action(text="", tool_calls=[{"id": tag, "type": "function",
                                                        "function": {"name": "finish", "arguments": "{}"}}]))
                continue
            m = seq[i] if isinstance(seq[i], dict) else {"content": seq[i]}
            out.append(_action_from_message(m, s.tools, tag))
        return out


@dataclass
class SamplerConfig:
    """How a model's turns are sampled: the rollouts of `train` and an hf or openai policy."""
    max_new_tokens: int = 4096
    """tokens per assistant turn"""
    temperature: float = 0.7
    """sampling temperature (0: greedy); training computes its log-probs at the same temperature"""
    kv_budget_gib: float | None = None
    """hf: GPU memory for the rollout engine's KV caches; beyond it idle episodes go to host memory (None: no limit)"""
    experts: str | None = None
    """hf: MoE experts implementation for the rollout engine ("fused": engine/moe_kernel.py's Triton decode kernels)"""


@dataclass
class PolicyConfig(SamplerConfig):
    kind: str = "replay"
    """who acts: "replay" (scripted) | "hf" (local transformers model) | "openai" (chat endpoint)"""
    model: str | None = None
    """hf: checkpoint path, or "tiny" for a random tiny MoE; openai: the served model name"""
    adapter: str | None = None
    """hf: optional peft adapter directory; a run's OUT/adapter also names its base model, so --policy.kind hf
    and --policy.model may be left out"""
    endpoint: str = "http://127.0.0.1:8000/v1"
    """openai: base URL of an OpenAI-compatible server (vLLM, SGLang, hosted API)"""
    api_key_env: str = "OPENAI_API_KEY"
    """openai: environment variable holding the API key"""
    script: str | None = None
    """replay: trajectory JSONL, or a JSON list of assistant messages (the same for every episode)"""


def sized_policy() -> PolicyConfig:
    """Policy defaults for this machine, like env.sized_env: 4096 tokens per turn with a GPU, 1024 on a
    CPU-only machine (a local hf model samples there at tens of tokens per second)."""
    return PolicyConfig() if resolve_device("auto") == "cuda" else PolicyConfig(max_new_tokens=1024)


def resolve_policy(cfg: PolicyConfig) -> PolicyConfig:
    """--policy.adapter OUT/adapter (a folder `train` wrote) implies --policy.kind hf and, unless
    --policy.model names another, the run's base model (for the tiny preset: the base saved in the folder)."""
    base = adapter_base(cfg.adapter) if cfg.adapter else None
    if base is None:
        return cfg
    kind = "hf" if cfg.kind == "replay" and not cfg.script else cfg.kind
    return dataclasses.replace(cfg, kind=kind, model=base if cfg.model in (None, "tiny") else cfg.model)


def policy_problem(cfg: PolicyConfig) -> str | None:
    """What `cfg` lacks to build a policy, as one line naming the flag that supplies it (None: nothing).
    Commands call it while validating arguments, before any model, task or sandbox is loaded."""
    if cfg.adapter and not os.path.isdir(cfg.adapter):
        return f"--policy.adapter: no such directory {cfg.adapter}"
    cfg = resolve_policy(cfg)
    if cfg.kind not in ("replay", "hf", "openai"):
        return f"unknown --policy.kind {cfg.kind!r}: choose replay | hf | openai"
    if cfg.kind == "replay" and not cfg.script:
        return ("--policy.kind replay (the default) needs --policy.script FILE (a trajectory JSONL or a JSON list of "
                "assistant messages); for a model pass --policy.kind hf --policy.model PATH|tiny")
    if cfg.kind == "replay" and not os.path.isfile(cfg.script):
        return f"--policy.script: no such file {cfg.script}"
    if cfg.kind in ("hf", "openai") and not cfg.model:
        what = "a checkpoint path, or 'tiny'" if cfg.kind == "hf" else "the served model name"
        return f"--policy.kind {cfg.kind} needs --policy.model ({what})"
    if cfg.kind == "hf" and cfg.model == "tiny" and cfg.adapter:
        return (f"--policy.adapter {cfg.adapter} with --policy.model tiny: a tiny adapter needs the base saved "
                f"beside it (the OUT/adapter folder that train writes)")
    return None


def make_policy(cfg: PolicyConfig, device: str = "cpu", seed: int = 0, engine: bool = True):
    """The policy `cfg` describes. device: where an hf model runs (cuda: bf16); engine: for "hf", sample
    through engine.Engine (KV cache reused across turns) instead of the re-encoding `model.generate` loop.
    --policy.adapter with a folder `train` wrote loads that run's base model under the adapter (resolve_policy)."""
    cfg = resolve_policy(cfg)
    if cfg.kind == "replay":
        assert cfg.script, "--policy.kind replay needs --policy.script (a trajectory JSONL or a JSON list of messages)"
        if cfg.script.endswith(".jsonl"):
            return ReplayPolicy(cfg.script)
        with open(cfg.script) as f:
            return ReplayPolicy(json.load(f))
    if cfg.kind == "hf":
        assert cfg.model, "--policy.kind hf needs --policy.model (a checkpoint path, or 'tiny')"
        if cfg.model == "tiny":
            m, tok = build_tiny_model_and_tokenizer(seed=seed)
        else:
            m, tok = load_policy_model(cfg.model, adapter=cfg.adapter, device=device if device == "cuda" else "cpu",
                                       dtype="bfloat16" if device == "cuda" else "float32")
        m.eval()
        return HFPolicy(m, tok, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=seed,
                        engine=engine, kv_budget_gib=cfg.kv_budget_gib, experts=cfg.experts)
    if cfg.kind == "openai":
        assert cfg.model, "--policy.kind openai needs --policy.model (the served model name)"
        return OpenAIPolicy(cfg.model, endpoint=cfg.endpoint, api_key_env=cfg.api_key_env,
                            max_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    raise ValueError(f"unknown policy kind {cfg.kind!r}: replay | hf | openai")
