import msgpack
import pytest

from fedswarm.tasks import get_task
from fedswarm.tasks.checkpoint import model_hash, resolve_model
from fedswarm.tasks.llama import generate_greedy
from fedswarm.tasks.checkpoint import load_block_span, load_client_head
from fedswarm.tasks.tokenizer import ByteTokenizer


@pytest.fixture
def task():
    return get_task("llm-batch")


BASE = {"model": "tiny-llama-gqa", "prompts": ["one", "two two", "three", "four"], "max_new_tokens": 6,
        "shard_size": 3}


def test_shards_slice_prompts_and_match_reference(task):
    assert task.num_shards(BASE) == 2
    r0, r1 = task.run(BASE, 0, device="cpu"), task.run(BASE, 1, device="cpu")
    assert [o["index"] for o in r0["outputs"]] == [0, 1, 2]
    assert [o["index"] for o in r1["outputs"]] == [3]
    d = resolve_model("tiny-llama-gqa")
    assert r0["model_hash"] == model_hash(d)
    head, span = load_client_head(d), load_block_span(d, 0, 4)
    tok = ByteTokenizer()
    for o in r0["outputs"] + r1["outputs"]:
        ids = tok.encode(BASE["prompts"][o["index"]])
        assert o["prompt_tokens"] == len(ids)
        assert o["token_ids"] == generate_greedy(head, [span], ids, 6)
        assert o["text"] == tok.decode(o["token_ids"])
    assert msgpack.unpackb(msgpack.packb(r0)) == r0
    est = task.estimate(BASE)
    assert est.mem_bytes > 3_000_000 and est.ref_seconds > 0


def test_prompt_ids_and_sampling(task):
    p = {"model": "tiny-llama", "prompt_ids": [[256, 1, 2], [256, 9]], "max_new_tokens": 5}
    r = task.run(p, 0, device="cpu")
    assert [len(o["token_ids"]) for o in r["outputs"]] == [5, 5]
    s = {**p, "greedy": False, "seed": 11, "temperature": 1.5}
    assert task.run(s, 0, device="cpu") == task.run(s, 0, device="cpu")
    assert task.run({**s, "seed": 12}, 0, device="cpu") != task.run(s, 0, device="cpu")
    assert task.run({**p, "model_hash": r["model_hash"]}, 0, device="cpu") == r


@pytest.mark.parametrize(
    "bad",
    [
        {"model": "../../etc"},
        {"model": "/tmp/x"},
        {"model": "nonexistent"},
        {"prompts": "a string"},
        {"prompts": []},
        {"prompts": [1, 2]},
        {"prompts": ["x"], "prompt_ids": [[1]]},
        {"prompts": None, "prompt_ids": [[1, 600]]},
        {"prompts": None, "prompt_ids": [[]]},
        {"prompts": None, "prompt_ids": [[True]]},
        {"max_new_tokens": 0},
        {"max_new_tokens": 5000},
        {"greedy": "yes"},
        {"temperature": 0},
        {"shard_size": 0},
        {"dtype": "float64"},
        {"model_hash": "0" * 64},
        {"prompts": ["x" * 600]},  # longer than the model's 512 positions
        {"pickle": b"\x80"},
    ],
)
def test_bad_params(task, bad):
    p = {**BASE, **bad}
    p = {k: v for k, v in p.items() if v is not None}
    with pytest.raises(ValueError):
        task.estimate(p) if "model_hash" not in bad else task.run(p, 0, device="cpu")


@pytest.mark.parametrize("shard", [-1, 2, True])
def test_bad_shard(task, shard):
    with pytest.raises(ValueError):
        task.run(BASE, shard, device="cpu")
