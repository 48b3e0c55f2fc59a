"""policy.py: tool-call parsing, exact token records (render deltas), the tiny MoE, the OpenAI client
against a local stand-in server, and replay."""
import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from env import EpisodeState, tokenize_conversation
from policy import (HFPolicy, OpenAIPolicy, PolicyConfig, ReplayPolicy, build_tiny_model_and_tokenizer, make_policy,
                    parse_tool_calls)

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
    "required": ["command"]}}},
    {"type": "function", "function": {"name": "finish", "description": "stop", "parameters": {
        "type": "object", "properties": {}, "required": []}}}]


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model_and_tokenizer(seed=0)


# ---------------------------------------------------------------------------------------------- parsing
def test_parse_json_calls_with_trailing_text_and_several_calls():
    text = ('I will look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
            '<tool_call>{"name": "finish", "arguments": {}} trailing junk</tool_call> bye')
    content, calls, errors = parse_tool_calls(text, TOOLS)
    assert errors == []
    assert [c["function"]["name"] for c in calls] == ["bash", "finish"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"command": "ls"}
    assert content == "I will look.\n\n bye"
    assert len({c["id"] for c in calls}) == 2


def test_parse_qwen3_coder_xml_calls_typed_by_schema():
    text = ("<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n"
            "<parameter=timeout>\n5\n</parameter>\n</function>\n</tool_call>")
    content, calls, errors = parse_tool_calls(text, TOOLS)
    assert errors == [] and content == ""
    assert json.loads(calls[0]["function"]["arguments"]) == {"command": "ls -la", "timeout": 5}


@pytest.mark.parametrize("bad", [
    '<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>',   # broken JSON
    '<tool_call>{"arguments": {}}</tool_call>',                                 # no name
    '<tool_call>{"name": "bash", "arguments": [1, 2]}</tool_call>',             # args not an object
    '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}',              # unterminated
    '<tool_call>hello</tool_call>',                                             # no JSON at all
    'text </tool_call>',                                                        # stray closer
])
def test_parse_garbage_becomes_errors_not_exceptions(bad):
    content, calls, errors = parse_tool_calls(bad, TOOLS)
    assert calls == [] and len(errors) == 1 and errors[0].startswith("malformed tool call")


def test_parse_mixed_good_and_bad_keeps_good():
    text = '<tool_call>{"name": "finish", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
    content, calls, errors = parse_tool_calls(text)
    assert len(calls) == 1 and len(errors) == 1 and "{oops}" in content


# ---------------------------------------------------------------------------------------------- tokenizer + template
def test_tiny_tokenizer_special_tokens_and_template(tiny):
    _, tok = tiny
    for t in ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]:
        assert len(tok.encode(t, add_special_tokens=False)) == 1
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
            {"role": "tool", "tool_call_id": "c0", "content": "a.py"}]
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "bash"' in text.split("</tools>")[0]                      # schemas rendered
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>' in text
    assert "<tool_response>\na.py\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    # the template's own tool-call format parses back to the same call
    _, calls, errors = parse_tool_calls(text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0])
    assert errors == [] and calls[0]["function"]["name"] == "bash"


def test_tokenize_conversation_scripted_turns_mask_is_the_assistant_text(tiny):
    _, tok = tiny
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "A2"}]
    ids, mask = tokenize_conversation(msgs, None, tok)
    pol = tok.decode([i for i, m in zip(ids, mask) if m])
    assert pol == "A1<|im_end|>A2<|im_end|>"
    # concatenated segments decode to the template's full rendering (which adds a newline after the last turn)
    assert tok.decode(ids) + "\n" == tok.apply_chat_template(msgs, tokenize=False)


def test_tokenize_conversation_length_cut_turn_gets_unmasked_end_token(tiny):
    _, tok = tiny
    a = tok.encode("abc", add_special_tokens=False)   # sampled ids without <|im_end|> (finish_reason length)
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "abc", "token_ids": a},
            {"role": "user", "content": "again"}]
    ids, mask = tokenize_conversation(msgs, None, tok)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    k = ids.index(a[0])
    assert ids[k:k + len(a)] == a and mask[k:k + len(a)] == [1] * len(a)
    assert ids[k + len(a)] == eot and mask[k + len(a)] == 0


# ---------------------------------------------------------------------------------------------- HF policy
class RecordingHF(HFPolicy):
    """Remembers each prompt it was given, to check prompts are prefixes of the final record."""
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.prompts = {}

    def prompt_ids(self, s):
        p = super().prompt_ids(s)
        self.prompts.setdefault(s.episode_id, []).append(p)
        return p


@pytest.mark.slow
def test_hf_policy_batched_turns_exact_ids_and_masks(tiny):
    model, tok = tiny
    pol = RecordingHF(model, tok, max_new_tokens=24, temperature=1.0, seed=1)
    convs = {0: [{"role": "system", "content": "sys"}, {"role": "user", "content": "write a kernel"}],
             1: [{"role": "user", "content": "a different, longer prompt for episode one"}]}
    sampled = {0: [], 1: []}
    for turn in range(3):
        acts = pol.act([EpisodeState(e, convs[e], TOOLS) for e in (0, 1)])
        for e, a in zip((0, 1), acts):
            assert a.finish_reason in ("stop", "length") and len(a.token_ids) == len(a.logprobs) > 0
            assert all(lp <= 0 for lp in a.logprobs)
            assert (a.token_ids[-1] == pol.eot_id) == (a.finish_reason == "stop")
            sampled[e].append(a.token_ids)
            convs[e] = convs[e] + [a.message(), {"role": "user", "content": f"observation {turn}"}]
    for e in (0, 1):
        ids, mask = tokenize_conversation(convs[e], TOOLS, tok)
        for p, s in zip(pol.prompts[e], sampled[e]):
            assert ids[:len(p)] == p, "a prompt is not a prefix of the final record"
            assert ids[len(p):len(p) + len(s)] == s and all(mask[len(p):len(p) + len(s)])
        assert sum(mask) == sum(map(len, sampled[e])), "mask covers tokens the policy did not sample"
        # round trip through JSON
        again = json.loads(json.dumps(convs[e]))
        assert tokenize_conversation(again, TOOLS, tok) == (ids, mask)


def test_hf_policy_logprobs_match_a_forward_pass(tiny):
    import torch
    model, tok = tiny
    pol = HFPolicy(model, tok, max_new_tokens=8, temperature=1.0, seed=3)
    st = EpisodeState(0, [{"role": "user", "content": "hello"}], None)
    a = pol.act([st])[0]
    p = pol.prompt_ids(st)
    with torch.no_grad():
        logits = model(torch.tensor([p + a.token_ids])).logits[0, len(p) - 1:-1].float()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(a.token_ids)[:, None])[:, 0]
    assert torch.allclose(ref, torch.tensor(a.logprobs), atol=1e-4)


def test_hf_policy_engine_path_matches_plain_path(tiny):
    """With engine.Engine (KV cache kept across turns) greedy turns equal the plain generate path."""
    engine = pytest.importorskip("engine")
    model, tok = tiny
    model = model.float()
    eng = engine.Engine(model, tok, max_batch=4, max_new_tokens=12, temperature=0.0,
                        stop_ids={tok.convert_tokens_to_ids("<|im_end|>")})
    fast = HFPolicy(model, tok, max_new_tokens=12, temperature=0.0, engine=eng)
    plain = HFPolicy(model, tok, max_new_tokens=12, temperature=0.0)
    convs = {e: [{"role": "user", "content": "episode %d " % e * (e + 1)}] for e in range(3)}
    caches = {e: {} for e in convs}
    for turn in range(3):
        states = [EpisodeState(e, convs[e], TOOLS, caches[e]) for e in convs]
        a_fast, a_plain = fast.act(states), plain.act(states)
        for e, af, ap in zip(convs, a_fast, a_plain):
            assert af.token_ids == ap.token_ids and af.finish_reason == ap.finish_reason
            convs[e] = convs[e] + [af.message(), {"role": "user", "content": f"obs {turn}"}]
    for e in convs:
        fast.release(e)
        assert e not in eng.episodes


@pytest.mark.parametrize("engine", [False, True])
def test_hf_policy_samples_within_the_token_budget(tiny, engine):
    """A turn samples at most budget - len(prompt) - 1 tokens (the last one is for the end-of-turn token that
    closes a cut turn); with no room left it samples nothing and says "context"; no budget: --max-new-tokens."""
    model, tok = tiny
    pol = HFPolicy(model.float(), tok, max_new_tokens=12, temperature=1.0, seed=0, engine=engine or None)
    msgs = [{"role": "user", "content": "write a kernel"}]
    n = len(pol.prompt_ids(EpisodeState(0, msgs, TOOLS)))
    acts = pol.act([EpisodeState(e, msgs, TOOLS, {}, budget) for e, budget in
                    enumerate((n + 4, n + 1, n - 3, None, n + 100))])
    assert len(acts[0].token_ids) <= 3 and acts[0].finish_reason in ("stop", "length")
    assert n + len(acts[0].token_ids) + (acts[0].finish_reason == "length") <= n + 4
    for a in acts[1:3]:
        assert (a.token_ids, a.logprobs, a.finish_reason, a.n_context) == ([], [], "context", n)
    assert 0 < len(acts[3].token_ids) <= 12 and 0 < len(acts[4].token_ids) <= 12


@pytest.mark.slow
def test_hf_policy_engine_takes_the_experts_implementation(tiny):
    """--sampler.experts reaches the engine: HFPolicy(engine=True, experts="fused") decodes through moe_kernel's
    kernels (the Triton interpreter on CPU) and greedy turns equal the plain path's."""
    pytest.importorskip("triton")
    from engine import moe_kernel
    model, tok = tiny
    model = model.float()
    fast = HFPolicy(model, tok, max_new_tokens=8, temperature=0.0, engine=True, experts="fused")
    plain = HFPolicy(model, tok, max_new_tokens=8, temperature=0.0)
    assert fast.engine.experts == "fused"
    calls, real = [], moe_kernel.fused_moe
    moe_kernel.fused_moe = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        states = [EpisodeState(e, [{"role": "user", "content": f"task {e}"}], TOOLS, {}) for e in range(2)]
        assert [a.token_ids for a in fast.act(states)] == [a.token_ids for a in plain.act(states)]
    finally:
        moe_kernel.fused_moe = real
    assert calls


# ---------------------------------------------------------------------------------------------- OpenAI client
class _Server:
    """A stand-in /v1/chat/completions: fails once with 503, then answers with a tool call."""
    def __init__(self):
        self.requests, self.fail_first = [], True
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, dict(self.headers), body))
                if outer.fail_first:
                    outer.fail_first = False
                    self.send_response(503)
                    self.end_headers()
                    return
                msg = {"role": "assistant", "content": "running it",
                       "tool_calls": [{"id": "call_x", "type": "function",
                                       "function": {"name": "bash", "arguments": '{"command": "nvidia-smi"}'}}]}
                data = json.dumps({"choices": [{"message": msg, "finish_reason": "tool_calls"}],
                                   "usage": {"total_tokens": 123}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_openai_policy_sends_tools_and_parses_tool_calls(monkeypatch):
    srv = _Server()
    monkeypatch.setenv("TEST_KEY", "sk-test")
    pol = OpenAIPolicy("m", endpoint=srv.url, api_key_env="TEST_KEY", backoff_s=0.01)
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "x", "token_ids": [1, 2]}]   # token_ids must not be sent
    a = pol.act([EpisodeState(7, msgs, TOOLS)])[0]
    srv.httpd.shutdown()
    assert len(srv.requests) == 2, "the 503 should have been retried once"
    path, headers, body = srv.requests[-1]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer sk-test"
    assert [t["function"]["name"] for t in body["tools"]] == ["bash", "finish"]
    assert "token_ids" not in body["messages"][1]
    assert a.tool_calls == [{"id": "call_x", "type": "function",
                             "function": {"name": "bash", "arguments": '{"command": "nvidia-smi"}'}}]
    assert a.content == "running it" and a.finish_reason == "stop" and a.n_context == 123


def test_openai_policy_unreachable_endpoint_is_an_error_action():
    pol = OpenAIPolicy("m", endpoint="http://127.0.0.1:9/v1", retries=1, backoff_s=0.01, timeout_s=2)
    a = pol.act([EpisodeState(0, [{"role": "user", "content": "go"}], TOOLS)])[0]
    assert a.tool_calls == [] and "policy endpoint error" in a.errors[0]


# ---------------------------------------------------------------------------------------------- replay
def test_replay_policy_per_episode_scripts_then_finish(tmp_path):
    pol = ReplayPolicy({0: ['<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'],
                        1: [{"content": "hi", "tool_calls": [{"function": {"name": "finish", "arguments": {}}}]}]})
    st = [EpisodeState(0, [], TOOLS), EpisodeState(1, [], TOOLS)]
    a0, a1 = pol.act(st)
    assert a0.tool_calls[0]["function"]["name"] == "bash"
    assert a1.tool_calls[0]["function"]["arguments"] == "{}" and a1.content == "hi"
    b0, _ = pol.act(st)
    assert b0.tool_calls[0]["function"]["name"] == "finish"   # script exhausted
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "u"},
                                          {"role": "assistant", "content": "A"}]}) + "\n")
    assert make_policy(PolicyConfig(kind="replay", script=str(p))).act(st[:1])[0].text == "A"


def test_load_policy_model_roundtrip_with_peft_adapter(tiny, tmp_path):
    """The real-checkpoint loader on a saved tiny model + a LoRA adapter (no download)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from policy import load_policy_model
    model, tok = tiny
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    lcfg = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora = get_peft_model(copy.deepcopy(model), lcfg)
    lora.save_pretrained(tmp_path / "adapter")
    m2, tok2 = load_policy_model(str(tmp_path / "base"), adapter=str(tmp_path / "adapter"), dtype="float32",
                                 device="cpu")
    ids = torch.tensor([tok.encode("def forward(self, x):")])
    with torch.no_grad():
        assert torch.allclose(m2(ids).logits, lora(ids).logits, atol=1e-5)
    assert tok2.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
