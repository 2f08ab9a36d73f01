"""Hub repo ids resolve through huggingface_hub's real snapshot_download, offline, from a cache.

The cache is built in the Hub's own layout (models--org--name/refs/main,
snapshots/<commit>/<file> -> ../../blobs/<hash>) under a temporary HF_HOME. huggingface_hub
reads HF_HOME and HF_HUB_OFFLINE when it is first imported, so the loads run in a fresh
Python process with that environment: exactly what a user's process sees.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from models.hub import is_repo_id, resolve_model_path

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_repo(hub_cache: Path, repo_id: str, model_dir: Path) -> Path:
    """Puts model_dir's files into hub_cache as a downloaded snapshot of repo_id at COMMIT."""
    storage = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / COMMIT
    (storage / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(COMMIT)
    for file in sorted(model_dir.iterdir()):
        data = file.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    return snapshot


_CHILD = """
import json, sys
import numpy as np
from models.loader import load_model, read_config
tiny_dir, commit = sys.argv[1:]
out = {}
for revision in (None, commit):
    via_hub = load_model("org/tiny-llama", revision=revision, dtype="float32")
    local = load_model(tiny_dir, dtype="float32")
    out[str(revision)] = {
        "path": str(via_hub.path),
        "same_embed": bool(np.array_equal(via_hub.params["embed"], local.params["embed"])),
        "same_config": via_hub.config == local.config,
        "vocab": via_hub.tokenizer.get_vocab_size(),
    }
out["read_config"] = read_config("org/tiny-llama").architecture
try:
    load_model("org/not-downloaded")
except ValueError as e:
    out["missing"] = str(e)
print(json.dumps(out))
"""


def test_repo_id_loads_from_offline_cache(tmp_path, tiny_checkpoints):
    hf_home = tmp_path / "hf_home"
    snapshot = _cache_repo(hf_home / "hub", "org/tiny-llama", tiny_checkpoints["llama"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tiny_checkpoints["llama"]), COMMIT],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for revision in ("None", COMMIT):
        assert out[revision] == {
            "path": str(snapshot),
            "same_embed": True,
            "same_config": True,
            "vocab": 2048,
        }
    assert out["read_config"] == "LlamaForCausalLM"
    assert out["missing"] == (
        f"model org/not-downloaded is not in the Hugging Face cache ({hf_home / 'hub'}) and "
        "HF_HUB_OFFLINE is set, so the Hub is not asked; download it once with network "
        "access, or pass a local path"
    )


def test_local_paths_are_not_repo_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    # An existing relative directory shaped like a repo id is the directory.
    assert resolve_model_path("org/model") == Path("org/model")
    assert resolve_model_path(str(tmp_path / "missing")) == tmp_path / "missing"
    assert resolve_model_path("model.gguf") == Path("model.gguf")
    assert [is_repo_id(s) for s in ("Qwen/Qwen3-0.6B", "org/na.me-v2_1")] == [True, True]
    assert not any(
        is_repo_id(s) for s in ("/abs/path", "./org/name", "a/b/c", "../x", "org/..", "name")
    )
