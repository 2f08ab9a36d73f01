"""Compiled programs on disk, loaded without tracing: start-up in seconds when nothing changed.

JAX's persistent compilation cache (compilation_cache.py) saves the XLA compile but not the
tracing and lowering that come before it, which for a step program take seconds. This cache
keeps the compiled executable itself (jax.experimental.serialize_executable) under a key of
everything that changes the program:

    the program's name (a StepKey, "prelude", ...) and its static settings (model config,
    attention backend, layer layout, mesh), the shapes, dtypes and shardings of every
    argument and their tree, the jax and jaxlib versions, the platform, its devices and the
    XLA flags, the source of every module that shapes a traced program (jpaged/, models/,
    pallas_kernels/), and this file's FORMAT.

An entry is `MAGIC | sha256(body) | body` (body: the pickled argument and output trees and
the serialized executable), written to a temporary file and renamed into place, so a reader
never sees half an entry. An entry whose checksum or deserialization fails is deleted with a
warning and the program is built again; nothing unchecked is ever run.

A program JAX's persistent cache served is never stored: XLA:CPU re-serializes an
executable it read from that cache without its code (running such an entry failed with
'Function ... not found'). So where this cache is on, the engine leaves JAX's persistent
cache off (compilation_cache.enable(jax_cache=False)), and a program it finds there anyway
(a JAX cache the user configured) is compiled from that cache each start, as without this one.

Off across processes (each host compiles its part of a multi-host program) and where
JPAGED_EXECUTABLE_CACHE=off (the test suite, whose tests patch traced functions at run time,
which no key can see).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

FORMAT = 1
MAGIC = b"JPAGEDX1"
SUFFIX = ".jpx"
ENV = "JPAGED_EXECUTABLE_CACHE"  # "off": never read or write entries
_ROOT = Path(__file__).resolve().parents[2]
_SOURCE_PACKAGES = ("jpaged", "models", "pallas_kernels")


@functools.cache
def source_fingerprint() -> str:
    """sha256 over the source of every module that can shape a traced program (and the CPU
    CPU kernels' C++, whose calls a CPU program holds)."""
    h = hashlib.sha256()
    for package in _SOURCE_PACKAGES:
        paths = [*(_ROOT / package).rglob("*.py"), *(_ROOT / package).rglob("*.cc"),
                 *(_ROOT / package).rglob("*.h")]
        for path in sorted(paths):
            h.update(str(path.relative_to(_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _environment() -> str:
    import jaxlib

    from pallas_kernels import cpu_kernel

    devices = jax.devices()
    # A CPU program calls the attention kernel where it built (pallas_kernels/cpu_kernel.py):
    # asking registers it, before any entry that holds its call is loaded.
    kernel = jax.default_backend() == "cpu" and cpu_kernel.available()
    return repr(
        (
            FORMAT,
            jax.__version__,
            jaxlib.__version__,
            jax.default_backend(),
            [(d.platform, d.device_kind) for d in devices],
            jax.process_count(),
            os.environ.get("XLA_FLAGS", ""),
            os.environ.get("JPAGED_GPU_KERNEL", ""),
            bool(jax.config.jax_enable_x64),
            kernel,
        )
    )


def _aval(x) -> str:
    sharding = getattr(x, "sharding", None)
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    where = None if spec is None else (str(spec), tuple(mesh.shape.items()))
    return f"{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}:{where}"


def cache_key(name: str, identity: str, args: tuple) -> str:
    """The entry's key: sha256 of the program's name and static identity, the arguments'
    tree, shapes, dtypes and shardings, the environment and the source."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    h = hashlib.sha256()
    for part in (
        name,
        identity,
        str(tree),
        *map(_aval, leaves),
        _environment(),
        source_fingerprint(),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def wanted() -> bool:
    """Whether an engine in this process keeps its programs here (given a directory)."""
    return os.environ.get(ENV, "").lower() != "off" and jax.process_count() == 1


class ExecutableCache:
    """One directory of entries. Counts what it loaded and what it refused."""

    def __init__(self, directory: str | os.PathLike | None) -> None:
        self.directory = None
        if directory is not None and wanted():
            path = Path(directory)
            try:
                path.mkdir(parents=True, exist_ok=True)
                self.directory = path
            except OSError as e:
                logger.warning("executable cache off: cannot create %s: %s", path, e)
        self.num_rebuilt = 0  # entries found corrupt or stale, deleted and built again

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def load(self, key: str, name: str):
        """The compiled program of key, or None (no entry, or a bad one, deleted)."""
        if not self.enabled:
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("executable cache: cannot read %s: %s", path, e)
            return None
        try:
            body = data[len(MAGIC) + 32 :]
            if (
                data[: len(MAGIC)] != MAGIC
                or hashlib.sha256(body).digest() != data[len(MAGIC) : len(MAGIC) + 32]
            ):
                raise ValueError("truncated or corrupt (checksum mismatch)")
            in_tree, out_tree, payload = pickle.loads(body)
            from jax.experimental import serialize_executable

            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 - any bad entry is rebuilt, never run
            logger.warning(
                "executable cache: entry for %s is unusable (%s); rebuilding it", name, e
            )
            self.num_rebuilt += 1
            path.unlink(missing_ok=True)
            return None

    def store(self, key: str, compiled) -> None:
        """Writes compiled under key (atomically); a failure to write is logged, not raised."""
        if not self.enabled:
            return
        try:
            from jax.experimental import serialize_executable

            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            body = pickle.dumps((in_tree, out_tree, payload), protocol=pickle.HIGHEST_PROTOCOL)
            data = MAGIC + hashlib.sha256(body).digest() + body
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
        except Exception as e:  # noqa: BLE001 - the program runs either way
            logger.warning("executable cache: not stored (%s: %s)", type(e).__name__, e)
