"""tasks.py: every loader returns Task; trajectories round-trip through JSONL."""
import json
import os

import pytest

import tasks
from tasks import Task, Trajectory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")


def test_load_tasks_ops6k_jsonl_and_parquet(tmp_path):
    ts = tasks.load_tasks(os.path.join(FIX, "synth", "ops6k_sample.jsonl"))
    assert [t.ops for t in ts] == [["nn.Conv2d", "torch.relu"], ["torch.tanh"], ["LlamaRMSNorm"]]
    assert [t.data_source for t in ts] == ["torch#2", "torch#1", "transformers"]
    assert all(len(t.hash) == 16 and t.name == t.hash and "class Model" in t.code for t in ts)
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = tmp_path / "ops.parquet"
    pd.DataFrame([{"code": t.code, "ops": t.ops, "data_source": t.data_source} for t in ts]).to_parquet(path)
    assert [t.ops for t in tasks.load_tasks(str(path))] == [t.ops for t in ts]


def test_shipped_tiny_set_keeps_hash_and_extra_columns():
    ts = tasks.load_tasks(os.path.join(ROOT, "data", "tasks_tiny.jsonl"))
    assert ts and all(t.hash == t.name for t in ts)
    assert all("eager_ms" in t.extra for t in ts)
    assert tasks.load_tasks(os.path.join(ROOT, "data"))[0].hash == ts[0].hash   # a folder of task files


def test_hash_ignores_comments_and_docstrings():
    a = "import torch\nclass Model:\n    '''doc'''\n    def f(self):\n        return 1\n"
    assert tasks.source_hash(a) == tasks.source_hash(a.replace("return 1", "return 1  # same"))
    assert tasks.source_hash(a) != tasks.source_hash(a.replace("return 1", "return 2"))


def test_kernelbench_checkout_and_jsonl_agree(tmp_path):
    local = tasks.load_kernelbench(os.path.join(FIX, "kernelbench"), [1, 2])
    assert [(t.level, t.problem_id) for t in local] == sorted((t.level, t.problem_id) for t in local)
    assert local[0].name == "Tiny_ReLU" and local[0].path.endswith("1_Tiny_ReLU.py")
    assert tasks.load_kernelbench(os.path.join(FIX, "kernelbench")) == local     # every level found
    path = tmp_path / "kb.jsonl"
    path.write_text("".join(json.dumps({"code": t.code, "level": t.level, "name": f"{t.problem_id}_{t.name}.py",
                                        "problem_id": t.problem_id}) + "\n" for t in local))
    hf = tasks.load_kernelbench(str(path), [1, 2])
    assert [(t.level, t.problem_id, t.name, t.code) for t in hf] == [(t.level, t.problem_id, t.name, t.code)
                                                                      for t in local]
    with pytest.raises(FileNotFoundError):
        tasks.load_kernelbench(os.path.join(FIX, "kernelbench"), [7])


def test_trajectory_round_trip(tmp_path):
    t = Trajectory(task="t", task_source="class Model: pass", messages=[{"role": "user", "content": "hi"}],
                   tools=None, ids=[1, 2], mask=[0, 1], logprobs=[0.0, -0.5], final_reward=2.0, source="demo")
    path = str(tmp_path / "a.jsonl")
    tasks.save_trajectories(path, [t], stage=1, step=3)
    assert json.loads(open(path).read())["stage"] == 1
    assert tasks.load_trajectories(path) == [t]


def test_task_from_file_and_row():
    p = os.path.join(FIX, "kernelbench", "KernelBench", "level1", "1_Tiny_ReLU.py")
    t = tasks.task_from_file(p)
    assert t.name == "1_Tiny_ReLU" and t.path == p and Task(code=t.code).hash == t.hash
    assert tasks.task_from_row({"code": t.code, "ops": "['a', 'b']", "x": 1}).to_row()["x"] == 1
