#!/usr/bin/env python3
"""Create the tiny random Llama checkpoints shipped in src/fedswarm/assets/models.

Reproducible: weights come from torch.Generator seeded with a fixed seed, so
re-running this script rewrites byte-identical files (and the same model_hash).

    .venv/bin/python scripts/make_tiny_models.py [--out DIR]

* tiny-llama      hidden 64, 4 layers, 4 heads (no GQA), untied lm_head,
                  linear RoPE scaling (factor 2), one model.safetensors.
* tiny-llama-gqa  hidden 128, 4 layers, 8 query heads / 2 KV heads, tied
                  embeddings, llama3 RoPE scaling, sharded into 2 files + index.

Both use the byte-level tokenizer of fedswarm.tasks.tokenizer (vocab 512 >= 259).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from fedswarm.tasks.checkpoint import SHIPPED_MODELS_DIR, model_hash, save_checkpoint  # noqa: E402
from fedswarm.tasks.llama import LlamaConfig, random_state_dict  # noqa: E402
from fedswarm.tasks.tokenizer import BOS_ID, EOS_ID  # noqa: E402

STD = 0.15  # large enough that greedy outputs vary token to token

COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "vocab_size": 512,
    "num_hidden_layers": 4,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "float32",
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "fedswarm_tokenizer": "bytes",
}

MODELS = {
    "tiny-llama": (
        {
            **COMMON,
            "hidden_size": 64,
            "intermediate_size": 176,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
        1234,
        1,
    ),
    "tiny-llama-gqa": (
        {
            **COMMON,
            "hidden_size": 128,
            "intermediate_size": 352,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        },
        5678,
        2,
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=SHIPPED_MODELS_DIR)
    args = ap.parse_args()
    for name, (config, seed, shards) in MODELS.items():
        d = args.out / name
        if d.exists():
            shutil.rmtree(d)
        cfg = LlamaConfig.from_hf_dict(config)
        save_checkpoint(d, config, random_state_dict(cfg, seed, std=STD), num_shards=shards)
        for p in d.iterdir():
            p.chmod(0o644)
        size = sum(p.stat().st_size for p in d.iterdir())
        print(f"{name}: {cfg.param_count()} params, {size} bytes, model_hash {model_hash(d)}")


if __name__ == "__main__":
    main()
