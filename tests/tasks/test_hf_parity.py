"""Our decoder against Hugging Face transformers' LlamaForCausalLM (local files only)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fedswarm.tasks.checkpoint import load_block_span, load_client_head, resolve_model  # noqa: E402
from fedswarm.tasks.llama import generate_greedy  # noqa: E402
from fedswarm.tasks.tokenizer import ByteTokenizer  # noqa: E402

N_NEW = 20


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-llama-gqa"])
def both(request):
    d = resolve_model(request.param)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(d), dtype=torch.float32, local_files_only=True).eval()
    return hf, load_client_head(d), d


def hf_greedy(hf, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_config_parsed_like_hf(both):
    hf, head, d = both
    cfg = head.config
    assert hf.config.num_key_value_heads == cfg.num_key_value_heads
    assert hf.config.tie_word_embeddings == cfg.tie_word_embeddings


@pytest.mark.parametrize("text", ["Hello, swarm!", "The quick brown fox"])
def test_greedy_matches_hf_token_for_token(both, text):
    hf, head, d = both
    prompt = ByteTokenizer().encode(text)
    ours_one = generate_greedy(head, [load_block_span(d, 0, 4)], prompt, N_NEW)
    ours_split = generate_greedy(head, [load_block_span(d, 0, 2), load_block_span(d, 2, 4)], prompt, N_NEW)
    ref = hf_greedy(hf, prompt, N_NEW)
    assert ours_one == ref
    assert ours_split == ref
    assert len(set(ref)) > 3  # not a degenerate repeat-one-token model


def test_logits_match_hf(both):
    hf, head, d = both
    ids = torch.randint(0, head.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    span = load_block_span(d, 0, 4)
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(head.logits(span(head.embed(ids))), ref, rtol=1e-5, atol=1e-5)
