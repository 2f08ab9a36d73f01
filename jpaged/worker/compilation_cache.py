"""JAX's persistent compilation cache, on by default, so a second start-up skips XLA compiles.

The cache lives in $JPAGED_CACHE_DIR/xla (else ~/.cache/jpaged/xla). Entries are keyed by the
program, the JAX version and the device, so a stale entry is never used for another program.
A cache directory the user configured for JAX itself (JAX_COMPILATION_CACHE_DIR or
jax.config) is left alone.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax

from models.demo import cache_root

logger = logging.getLogger(__name__)

# Programs that compile faster than this are not worth a disk entry (the engine's step
# programs take seconds; small helper programs take milliseconds).
MIN_COMPILE_SECONDS = 0.2


def default_dir() -> Path:
    return cache_root() / "xla"


def enable(path: str | None, *, jax_cache: bool = True) -> str | None:
    """The cache directory for path ("auto": default_dir(); None, "", "off": none), created;
    JAX's persistent cache pointed at it when jax_cache (the executable cache, which keeps
    the engine's programs whole, asks for it off: executable_cache.py says why).

    Returns the directory in use, or None when the cache is off.
    """
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    if not path or path.lower() in ("off", "none"):
        return None
    resolved = default_dir() if path == "auto" else Path(path)
    try:
        resolved.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home: run without the cache rather than fail
        logger.warning("compilation cache disabled: cannot create %s: %s", resolved, e)
        return None
    if not jax_cache:
        logger.info("compilation cache: %s (compiled programs, JAX's cache off)", resolved)
        return str(resolved)
    jax.config.update("jax_compilation_cache_dir", str(resolved))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    # JAX decides once per process whether the cache is used; make it look again (an
    # experimental API: where a JAX version lacks it, the cache still serves every process
    # that sets it before its first compile, as the engine's CLI and server do).
    try:
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
    except (ImportError, AttributeError) as e:
        logger.debug("compilation cache not reset: %s", e)
    logger.info("persistent compilation cache: %s", resolved)
    return str(resolved)
