"""Model arguments that name a Hugging Face Hub repo ("org/name") become local directories.

`resolve_model_path` returns an existing local path unchanged. Anything else shaped like a repo
id is fetched with huggingface_hub.snapshot_download into the Hub's own cache, keeping only
the files jpaged reads (HUB_FILES): a second call, or any call with the repo already cached,
reads no network. The library itself honours HF_HOME / HF_HUB_CACHE (where the cache is),
HF_TOKEN (gated and private repos) and HF_HUB_OFFLINE (cache only; read when huggingface_hub
is first imported).

Invariant: every failure to produce a directory is one ValueError naming the repo and why
(not cached while offline, the Hub unreachable, no such repo or revision).
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "*.safetensors",
    "model.safetensors.index.json",
]

# "org/name": the Hub's characters for both parts, no leading "." or "-", no "..".
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_repo_id(model: str) -> bool:
    """Whether model is shaped like a Hub repo id (and so is not meant as a relative path)."""
    return bool(_REPO_ID.fullmatch(model)) and ".." not in model


def resolve_model_path(model: str, revision: str | None = None) -> Path:
    """A local path for the model argument.

    Args:
      model: a local path (a directory or a .gguf file), or a Hub repo id "org/name".
      revision: branch, tag or commit of a Hub repo (default "main"); ignored for local paths.

    Returns:
      model itself when it exists locally or is not shaped like a repo id (the loader then
      reports it missing), else the snapshot directory in the Hugging Face cache.

    Raises:
      ValueError: the repo is not in the cache and HF_HUB_OFFLINE is set or the Hub cannot be
        reached, or the Hub has no such repo or revision (or refuses access).
    """
    path = Path(model)
    if path.exists() or not is_repo_id(model):
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{model}" + (f" (revision {revision})" if revision else "")
    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=HUB_FILES))
    except IncompleteSnapshotError as e:
        raise ValueError(f"model {where}: {str(e).splitlines()[0]}") from None
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            reason = "HF_HUB_OFFLINE is set, so the Hub is not asked"
        else:
            reason = "the Hugging Face Hub cannot be reached"
        raise ValueError(
            f"model {where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"{reason}; download it once with network access, or pass a local path"
        ) from None
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise ValueError(
            f"model {where}: no such repo on the Hugging Face Hub, or it needs a token with "
            f"access (HF_TOKEN) ({type(e).__name__})"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"model {where}: the repo has no such revision") from None
    except (HfHubHTTPError, OSError) as e:
        # OSError: for one, a cache directory that cannot be written.
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"model {where}: cannot fetch from the Hub: {first_line}") from None
