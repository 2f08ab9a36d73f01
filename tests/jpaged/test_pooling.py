"""Pooling: a request's chunks of hidden states become its embedding (exact values)."""

import json

import numpy as np
import pytest

from jpaged.pooling import Pooler, PoolingParams, sentence_transformers_pooling


def chunk(hidden: np.ndarray) -> np.ndarray:
    """What a step returns for a row computing these tokens' hidden states [n, D]."""
    return np.stack([hidden.sum(0), hidden[0], hidden[-1]]).astype(np.float32)


HIDDEN = np.array([[1.0, 2.0, 2.0], [3.0, 0.0, 4.0], [0.0, 6.0, 8.0], [2.0, 2.0, 1.0]])


@pytest.mark.parametrize(
    ("kind", "normalize", "dimensions", "want"),
    [
        ("last", False, None, [2.0, 2.0, 1.0]),
        ("last", True, None, [2 / 3, 2 / 3, 1 / 3]),
        ("mean", False, None, [1.5, 2.5, 3.75]),
        ("cls", True, None, [1 / 3, 2 / 3, 2 / 3]),
        ("cls", True, 2, [1 / 5**0.5, 2 / 5**0.5]),
        ("mean", False, 1, [1.5]),
    ],
)
def test_chunks_pool_into_the_embedding(kind, normalize, dimensions, want):
    params = PoolingParams(pooling_type=kind, normalize=normalize, dimensions=dimensions)
    pooler = Pooler(params, num_prompt_tokens=4, hidden_size=3)
    pooler.add(0, 3, chunk(HIDDEN[:3]))
    assert pooler.embedding is None
    pooler.add(3, 1, chunk(HIDDEN[3:]))
    np.testing.assert_allclose(pooler.embedding, want, rtol=1e-6)
    assert pooler.embedding.dtype == np.float32


def test_a_recomputed_prompt_starts_over_and_a_repeated_chunk_counts_once():
    pooler = Pooler(PoolingParams(pooling_type="mean", normalize=False), 4, 3)
    pooler.add(0, 2, chunk(HIDDEN[:2] * 10))
    pooler.add(0, 2, chunk(HIDDEN[:2]))  # preempted and recomputed from the start
    pooler.add(1, 1, chunk(HIDDEN[1:2]))  # not where the sums are: ignored
    pooler.add(2, 2, chunk(HIDDEN[2:]))
    np.testing.assert_allclose(pooler.embedding, [1.5, 2.5, 3.75])


def test_bad_pooling_params_name_the_field():
    with pytest.raises(ValueError, match="pooling_type must be one of last, mean, cls, got 'max'"):
        PoolingParams(pooling_type="max")
    with pytest.raises(ValueError, match="dimensions must be a positive integer, got 0"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match=r"dimensions \(8\) must be at most the model's hidden "
                                         r"size \(3\)"):  # fmt: skip
        Pooler(PoolingParams(dimensions=8), 4, 3)


def test_the_sentence_transformers_pooling_of_a_model_directory(tmp_path):
    assert sentence_transformers_pooling(tmp_path) is None
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    config = tmp_path / "1_Pooling" / "config.json"
    config.write_text(json.dumps({"word_embedding_dimension": 3, "pooling_mode_mean_tokens": True,
                                  "pooling_mode_cls_token": False}))  # fmt: skip
    assert sentence_transformers_pooling(tmp_path) == PoolingParams(pooling_type="mean")
    (tmp_path / "modules.json").write_text(json.dumps(modules[:2]))
    assert sentence_transformers_pooling(tmp_path) == PoolingParams(
        pooling_type="mean", normalize=False
    )
    config.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling .'pooling_mode_max_tokens'. is not supported"):
        sentence_transformers_pooling(tmp_path)
