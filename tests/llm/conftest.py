import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_dir():
    from fedswarm.tasks.checkpoint import resolve_model

    return resolve_model("tiny-llama")


@pytest.fixture(scope="session")
def gqa_dir():
    from fedswarm.tasks.checkpoint import resolve_model

    return resolve_model("tiny-llama-gqa")
