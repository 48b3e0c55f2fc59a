"""What `train` leaves behind is what users load: OUT/adapter/ is a peft adapter folder that `solve` and
`kernelbench_eval` take with --policy.adapter alone, and the actor they load is the actor that trained.

The tiny preset trains for a few steps (CPU, the real env and the CPU sandbox, correctness checks only), then:
  * OUT/adapter holds the actor (adapter_config.json + adapter_model.safetensors), critic/ (adapter + value
    head), base/ (the tiny random base, saved beside it) and cuda_agent.json naming the base;
  * log-probs of the actor loaded through policy.make_policy(--policy.adapter) equal the trainer's own actor
    (rebuilt and resumed from checkpoint.pt), and differ from the base: the adapter is really applied;
  * kernelbench_eval runs that adapter on two fixture problems (tests/fixtures/kernelbench) end to end.

Run: python -m pytest -q tests/test_adapter.py   (about 1-2 minutes on the 2-core box)
"""
import dataclasses
import json
import os

import pytest
import torch

import env
import kernelbench_eval as kb
import policy
import ppo
import runlog
import sandbox
import train
import train_config

pytestmark = pytest.mark.slow  # the module fixture trains an adapter (~40 s)

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "kernelbench")


def tiny_cfg(out: str) -> train_config.TrainConfig:
    base = train_config.PRESETS["tiny"]
    return train_config.updated(base, {
        "out": out, "warmup.steps": 2, "rft.steps": 0, "value.steps": 0, "agent.steps": 0, "warmup.batch_size": 2,
        "value.batch_size": 2, "agent.batch_size": 2, "ppo.micro_batch_size": 2, "ppo.epochs": 1,
        "ppo.num_minibatches": 1, "demos.fraction": 0.0, "sampler.max_new_tokens": 8, "ppo.lr_actor": 5e-2,
        "env.max_turns": 2, "sandbox.profile": False})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run"))
    cfg = tiny_cfg(out)
    n = torch.get_num_threads()
    try:
        assert train.train(cfg) == 0
    finally:
        torch.set_num_threads(n)
    return cfg


def test_adapter_folder_layout(trained):
    ad = os.path.join(trained.out, "adapter")
    for f in ("adapter_config.json", "adapter_model.safetensors", "cuda_agent.json",
              "critic/adapter_config.json", "critic/adapter_model.safetensors", "critic/value_head.safetensors",
              "base/config.json", "base/tokenizer.json"):
        assert os.path.isfile(os.path.join(ad, f)), f"{f} missing from {ad}: {sorted(os.listdir(ad))}"
    meta = json.load(open(os.path.join(ad, "cuda_agent.json")))
    assert meta["base_model"] == "base" and meta["stage"] == 5 and meta["preset"] == "tiny"
    assert not os.path.exists(ad + ".tmp") and not os.path.exists(ad + ".old")
    assert policy.adapter_base(ad) == os.path.join(ad, "base")


def test_loaded_actor_logprobs_equal_the_trained_actor(trained, tmp_path):
    ad = os.path.join(trained.out, "adapter")
    # the trainer's actor: rebuilt as `train` builds it and resumed from its last checkpoint
    model, head, tok = train.build_models(dataclasses.replace(trained, out=str(tmp_path)), torch.device("cpu"))
    assert runlog.load_checkpoint(trained.out, model, head)["stage"] == 5
    text = "__global__ void scale_kernel(const float* x, float* y, long n) { y[i] = x[i] * 2.0f; }"
    ids = torch.tensor([tok.encode(text)])
    attn = torch.ones_like(ids)
    with torch.no_grad():
        trained_lp = ppo.actor_logprobs(model, ids, attn)[0]
        base_lp = ppo.actor_logprobs(model, ids, attn, adapter=None)[0]
    # what users load: --policy.adapter alone (kind hf and the base model come from the folder)
    cfg = policy.PolicyConfig(adapter=ad, max_new_tokens=8)
    assert policy.policy_problem(cfg) is None
    pol = policy.make_policy(cfg, device="cpu", engine=False)
    assert isinstance(pol, policy.HFPolicy) and pol.tok.encode(text) == tok.encode(text)
    with torch.no_grad():
        logits = pol.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    loaded_lp = torch.nn.functional.pad(torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
    torch.testing.assert_close(loaded_lp, trained_lp, rtol=1e-5, atol=1e-5)
    assert (trained_lp - base_lp).abs().max() > 1e-3, "training left the actor at the base: the test cannot fail"


def test_kernelbench_eval_runs_the_adapter_on_two_fixture_problems(trained, tmp_path):
    ad = os.path.join(trained.out, "adapter")
    sb = sandbox.SandboxConfig(device="cpu", cache_dir=str(tmp_path / "cache"), mem_limit_mb=65536, profile=False)
    cfg = kb.EvalConfig(kernelbench_dir=FIX, level=[1], problems=[1, 2], out=str(tmp_path / "eval"), sandbox=sb,
                        policy=policy.PolicyConfig(adapter=ad, max_new_tokens=8), env=env.EnvConfig(max_turns=2))
    assert kb.main(cfg) == 0
    recs = kb.read_results(str(tmp_path / "eval" / "results.jsonl"))
    assert set(recs) == {(1, 1), (1, 2)}
    assert all(r["source"].startswith("agent:hf") for r in recs.values())   # the adapter acted, as an hf policy
    trajs = [json.loads(x) for x in open(tmp_path / "eval" / "trajectories.jsonl")]
    assert len(trajs) == 2 and all(t["turns"] for t in trajs)
