"""Copy-on-write copies in one step read every source before writing any page (on the
device and in tests/jpaged/core's fake runner alike): a page that forks' copies read and a
later copy writes (freed and reused within one plan) gives the readers its content from
before the step; a chain (a copy reading what an earlier copy writes) is what the fake
refuses, since the device would not follow it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.worker.programs import _copy_pages
from tests.jpaged.core.fake_runner import FakeRunner

NUM_LAYERS, NUM_PAGES = 2, 40


def _pool():  # [1 kv head, layers * pages, page_size 1, head_dim 1]: page p of layer l holds
    values = np.arange(NUM_LAYERS * NUM_PAGES, dtype=np.float32)  # l * NUM_PAGES + p
    return jnp.asarray(values.reshape(1, NUM_LAYERS * NUM_PAGES, 1, 1))


def test_device_copies_read_every_source_before_writing():
    copies = jnp.asarray([[8, 35], [8, 36], [10, 8], [0, 0]], jnp.int32)  # (0, 0): padding
    k, v = _copy_pages(_pool(), _pool(), copies, NUM_LAYERS)
    for pool in (k, v):
        got = np.asarray(pool).reshape(NUM_LAYERS, NUM_PAGES)
        for layer in range(NUM_LAYERS):
            base = layer * NUM_PAGES
            assert got[layer, 35] == got[layer, 36] == base + 8  # page 8 before the step
            assert got[layer, 8] == base + 10
            assert got[layer, 9] == base + 9  # untouched


class _Pool:
    """The fake runner's copy scatter on a bare pool (its _edit reads only these)."""

    _edit = FakeRunner._edit

    def __init__(self):
        self.pool = np.arange(NUM_PAGES, dtype=np.int64)[:, None] * np.ones((1, 2), np.int64)
        self.page_table = np.zeros((2, 2), np.int32)


def test_the_fake_runner_copies_as_the_device_does_and_refuses_chains():
    fake = _Pool()
    no_updates = np.zeros((0, 3), np.int32)
    fake._edit(no_updates, np.asarray([[8, 35], [8, 36], [10, 8], [0, 0]], np.int32))
    assert fake.pool[35].tolist() == fake.pool[36].tolist() == [8, 8]
    assert fake.pool[8].tolist() == [10, 10]
    with pytest.raises(AssertionError, match="a copy reads a page an earlier copy writes"):
        _Pool()._edit(no_updates, np.asarray([[10, 8], [8, 35]], np.int32))
