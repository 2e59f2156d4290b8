import pytest
import torch

from fedswarm.tasks.checkpoint import load_block_span, load_client_head, resolve_model
from fedswarm.tasks.llama import KVCache, _StepKV, generate, generate_greedy
from fedswarm.tasks.tokenizer import BOS_ID, ByteTokenizer

MODELS = ["tiny-llama", "tiny-llama-gqa"]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    d = resolve_model(request.param)
    return load_client_head(d), load_block_span(d, 0, 4), d


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (1, n), generator=g)


def full_logits(head, span, ids):
    return head.logits(span(head.embed(ids)))


# Cached decode and a full recompute sum in different orders: float32
# logits of magnitude ~7 differ by ~1e-5 (1.16e-5 seen on tiny-llama-gqa);
# a wrong cache position moves them by whole units.
def test_kv_cache_decode_equals_full_recompute(model):
    head, span, _ = model
    ids = _ids(12, 0)
    ref = full_logits(head, span, ids)
    cache = span.new_cache(32)
    out = [head.logits(span(head.embed(ids[:, :5]), cache))]  # prefill 5
    for t in range(5, 12):  # then one-token decode steps
        out.append(head.logits(span(head.embed(ids[:, t : t + 1]), cache)))
    assert cache.length == 12
    got = torch.cat(out, dim=1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    # Roll back and redo the last step: same result.
    cache.truncate(11)
    again = head.logits(span(head.embed(ids[:, 11:12]), cache))
    torch.testing.assert_close(again, ref[:, 11:12], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", ["row by row", "padded"])
def test_batched_decode_of_sessions_at_different_positions(model, rows, monkeypatch):
    # on the CPU each row of a batch of decode steps attends to its own
    # cache; elsewhere (an accelerator) one padded call with a mask does:
    # that path is run here too, on the CPU
    if rows == "padded":
        monkeypatch.setattr(_StepKV, "per_row_devices", ())
    head, span, _ = model
    prompts = [_ids(n, 10 + n) for n in (3, 9, 6)]
    caches = [span.new_cache(16) for _ in prompts]
    for p, c in zip(prompts, caches):
        span(head.embed(p), c)
    nxt = torch.tensor([[5], [77], [300]])
    # Batched step: rows sit at positions 3, 9 and 6.
    batched = head.logits(span(head.embed(nxt), caches))
    assert [c.length for c in caches] == [4, 10, 7]
    # Unbatched: each session alone, from fresh caches.
    for b, p in enumerate(prompts):
        c = span.new_cache(16)
        span(head.embed(p), c)
        alone = head.logits(span(head.embed(nxt[b : b + 1]), c))
        torch.testing.assert_close(batched[b : b + 1], alone, rtol=1e-5, atol=1e-4)
        full = full_logits(head, span, torch.cat([p, nxt[b : b + 1]], dim=1))[:, -1:]
        torch.testing.assert_close(batched[b : b + 1], full, rtol=1e-5, atol=1e-4)
    # A second batched step (now with a multi-token chunk per row) still agrees.
    chunk = torch.tensor([[1, 2], [3, 4], [5, 6]])
    two = head.logits(span(head.embed(chunk), caches))
    for b, p in enumerate(prompts):
        seq = torch.cat([p, nxt[b : b + 1], chunk[b : b + 1]], dim=1)
        torch.testing.assert_close(two[b : b + 1], full_logits(head, span, seq)[:, -2:], rtol=1e-5, atol=1e-4)


def test_split_spans_equal_one_span(model):
    head, span, d = model
    a, b = load_block_span(d, 0, 2), load_block_span(d, 2, 4)
    ids = _ids(10, 3)
    ref = span(head.embed(ids))
    mid = a(head.embed(ids))  # activations "sent" to the next server
    torch.testing.assert_close(b(mid.clone()), ref, rtol=0, atol=0)
    # With caches: per-span caches, prefill then decode.
    ca, cb, cfull = a.new_cache(16), b.new_cache(16), span.new_cache(16)
    out_split = b(a(head.embed(ids), ca), cb)
    out_full = span(head.embed(ids), cfull)
    torch.testing.assert_close(out_split, out_full, rtol=0, atol=0)
    step = torch.tensor([[42]])
    torch.testing.assert_close(b(a(head.embed(step), ca), cb), span(head.embed(step), cfull), rtol=0, atol=0)
    prompt = [BOS_ID] + list(b"split")
    assert generate_greedy(head, [a, b], prompt, 10) == generate_greedy(head, [span], prompt, 10)


def test_generate_batch_equals_single(model):
    head, span, _ = model
    tok = ByteTokenizer()
    prompts = [tok.encode(s) for s in ("a", "hello there", "swarm")]
    batch = generate(head, [span], prompts, 8)
    assert batch == [generate_greedy(head, [span], p, 8) for p in prompts]
    assert all(len(o) == 8 for o in batch)


def test_cache_errors(model):
    head, span, d = model
    c = span.new_cache(4)
    with pytest.raises(ValueError, match="overflow"):
        span(head.embed(_ids(5, 0)), c)
    with pytest.raises(ValueError):
        span(head.embed(_ids(2, 0)), [c, c])
    other = load_block_span(d, 0, 1).new_cache(4)
    with pytest.raises(ValueError, match="different size"):
        span(head.embed(_ids(2, 0)), other)
    with pytest.raises(ValueError):
        span.new_cache(10**6)
    with pytest.raises(ValueError):
        generate(head, [load_block_span(d, 1, 4)], [[1, 2]], 2)
    assert isinstance(c, KVCache) and c.nbytes > 0


def test_bfloat16_runs_and_is_close():
    d = resolve_model("tiny-llama-gqa")
    head32, span32 = load_client_head(d), load_block_span(d, 0, 4)
    head16, span16 = load_client_head(d, dtype="bfloat16"), load_block_span(d, 0, 4, dtype="bfloat16")
    ids = _ids(8, 1)
    l32 = full_logits(head32, span32, ids)
    l16 = full_logits(head16, span16, ids)
    assert l16.dtype == torch.float32 and torch.isfinite(l16).all()
    assert torch.nn.functional.cosine_similarity(l16.flatten(), l32.flatten(), dim=0) > 0.98
    c = span16.new_cache(12)
    assert c.k.dtype == torch.bfloat16
    span16(head16.embed(ids), c)


def test_tokenizer_roundtrip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == BOS_ID and max(ids[1:]) < 256
    assert tok.decode(ids + [257, 400]) == "héllo"
