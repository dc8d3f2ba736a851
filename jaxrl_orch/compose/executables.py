"""Compiled programs kept whole across starts: ``ExecutableStore``.

The persistent compilation cache (``compile_cache``) saves a restart the compile only: every
start still traces each program in Python and lowers it to StableHLO before it can look the
compile up, and on the main job that was two thirds of the engine's warm-up on a warm cache
(docs/benchmarks.md: where a warm restart's seconds go). The store keeps the compiled
executable itself (``jax.experimental.serialize_executable``), keyed by what the program is, so
a later start loads it without tracing or lowering. MaxText's ``compiled_trainstep_file`` does
this for a train step by hand; here it covers the engine's programs (every prompt bucket's
prefill and insert, each decode width, the slot move, the state's init) and the trainer's (the
step, the learning rate it logs, its key split).

Where a program is kept: ``<digest of fingerprint and group>-<digest of name and signature>``.
- The group is its owner's programs, named with everything static they are built from (the
  engine's model config, limits, dtypes and seed; the trainer's model, step and optimizer
  configs: the learning rate is baked into the step); the name tells them apart (a prompt
  bucket's prefill, a decode width).
- The signature is each argument's tree structure, shape, dtype, weak type, sharding and device
  ids (``signature``).
- The ``fingerprint`` is this process's: the source of every ``jaxrl_orch`` and ``sharding`` file
  and of every other module loaded from outside the installed packages and the standard library
  (a user's plugin), the versions of JAX, jaxlib, Flax, Optax and qwix, the backend, its platform
  version and devices, ``XLA_FLAGS`` / ``LIBTPU_INIT_ARGS`` and the JAX settings that change a
  lowering.
A change to any of them is another file: nothing stale is ever loaded. When an owner wraps its
first program, every kept program of its group starts loading on two threads of the store's
(a load leaves the interpreter free), so the loads overlap the rest of the start.

Only a program this process compiled afresh is stored: an executable that the compilation cache
itself loaded could not be serialized again and run on CPU (``NOT_FOUND: Function
iota_convert_fusion``, jax 0.10.2), so a compile that hit the cache stores nothing. One process
only (``jax.process_count() == 1``): a multi-process program's executable is each process's
own and keeps to the compilation cache.

Trust: a stored executable is machine code the run loads, like the compilation cache's entries;
the store lives in the cache's directory (``<Processes.compile_cache>/executables``), a local one
the operator chose, never a URL. A file that cannot be read back is said in one line, removed,
counted (``failed``) and compiled again; a store that cannot be written is said once and the run
goes on without it.

What it owns: ``ExecutableStore`` (``program(group, name, jitted)`` wraps a ``jax.jit`` function;
``summary()``: loaded, stored, compiled, failed) and ``StoredProgram`` (called like the jitted
function; ``prepare(*args)`` loads or compiles it for those arguments, concrete or abstract).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.metadata
import os
import pickle
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

from jaxrl_orch.compose.compile_cache import hit_on_this_thread, reset_thread_hits
from jaxrl_orch.orchestrator.metrics.writers import stage

FORMAT = b"jaxrl-orch-executable-2\n"
VERSIONED = ("jax", "jaxlib", "flax", "optax", "qwix")
_OWN = ("jaxrl_orch", "sharding")
_JAX_SETTINGS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
)


class ExecutableStore:
    """Executables under ``directory`` (see the module docstring); ``directory`` must exist."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fingerprint: str | None = None
        self._lock = threading.Lock()
        self._said: set[str] = set()
        self._loads: dict[str, dict[str, concurrent.futures.Future]] = {}
        self.loaded = self.stored = self.compiled = self.failed = 0

    def program(self, group: str, name: str, jitted: Any) -> StoredProgram:
        """``jitted`` as the program ``name`` of ``group`` (an owner's programs, named with all
        they are built from). The group's stored executables start loading now, two at a time
        on threads of their own (a load leaves the interpreter free), while the start goes on."""
        self._preload(group)
        return StoredProgram(self, group, name, jitted)

    def summary(self) -> dict[str, Any]:
        with self._lock:
            counts = (self.loaded, self.stored, self.compiled, self.failed)
        return dict(zip(("loaded", "stored", "compiled", "failed"), counts, strict=True))

    def executable(self, group: str, name: str, jitted: Any, args: tuple) -> Any:
        """``jitted``'s executable for ``args``: loaded when stored, else compiled (and stored
        when this process compiled it afresh)."""
        if jax.process_count() > 1:  # each process's own program: the compilation cache's
            return jitted.lower(*args).compile()
        path = self.directory / f"{self._prefix(group)}-{_digest(name, signature(args))}"
        loading = self._loads.get(group, {}).get(path.name)
        loaded = self._load(path) if loading is None else loading.result()
        if loaded is not None:
            return loaded
        reset_thread_hits()
        compiled = jitted.lower(*args).compile()
        self._count("compiled")
        if not hit_on_this_thread():
            self._store(path, compiled)
        return compiled

    def _prefix(self, group: str) -> str:
        with self._lock:
            if self._fingerprint is None:
                self._fingerprint = fingerprint()
            return _digest(self._fingerprint, group)

    def _preload(self, group: str) -> None:
        with self._lock:
            if group in self._loads:
                return
            loads = self._loads[group] = {}
        if jax.process_count() > 1:
            return
        pool = concurrent.futures.ThreadPoolExecutor(2, "executables")
        for path in self.directory.glob(f"{self._prefix(group)}-*"):
            loads[path.name] = pool.submit(self._load, path)
        pool.shutdown(wait=False)  # its threads end with the last load

    def _load(self, path: Path) -> Any:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._say("read", f"cannot read {path} ({exc}); compiling instead")
            return None
        try:
            if not raw.startswith(FORMAT):
                raise ValueError("not a stored executable")
            blob, in_tree, out_tree, ids = pickle.loads(raw[len(FORMAT) :])
            by_id = {d.id: d for d in jax.devices()}
            compiled = serialize_executable.deserialize_and_load(
                blob, in_tree, out_tree, execution_devices=[by_id[i] for i in ids]
            )
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is compiled afresh
            stage(
                "executables",
                f"{path.name} could not be loaded ({exc!r:.200}); removed, compiled again",
            )
            self._count("failed")
            path.unlink(missing_ok=True)
            return None
        self._count("loaded")
        return compiled

    def _store(self, path: Path, compiled: Any) -> None:
        try:
            # The devices it runs on, in their order: loaded without them, it would span all.
            ids = [d.id for d in compiled.runtime_executable().local_devices()]
            blob = FORMAT + pickle.dumps((*serialize_executable.serialize(compiled), ids))
        except Exception as exc:  # noqa: BLE001 - a program that cannot be kept still runs
            self._say(
                "serialize", f"a program could not be kept ({exc!r:.200}); it compiles each start"
            )
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            tmp.write_bytes(blob)
            os.replace(tmp, path)  # whole or absent: a reader never sees half a file
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            self._say("write", f"cannot write {self.directory} ({exc}); programs are not kept")
            return
        self._count("stored")

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def _say(self, kind: str, line: str) -> None:
        with self._lock:
            if kind in self._said:
                return
            self._said.add(kind)
        stage("executables", line)


class StoredProgram:
    """A ``jax.jit`` function whose executables come from an ``ExecutableStore``. Called with
    the jitted function's positional arguments (every one an array or a Python scalar: what
    is static is in ``name``); anything else it does not take (``lower``, ``trace``) is the
    jitted function's own."""

    def __init__(self, store: ExecutableStore, group: str, name: str, jitted: Any) -> None:
        self._store = store
        self._group = group
        self._name = name
        self._jitted = jitted
        self._executables: dict[str, Any] = {}
        self._last: Any = None

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._jitted, attr)

    def __call__(self, *args: Any) -> Any:
        last = self._last
        if last is not None:
            try:
                return last(*args)
            except (TypeError, ValueError):
                # A Compiled checks its arguments' shapes, dtypes and shardings before it runs
                # (nothing donated yet) and raises on a mismatch: take the one for these below.
                pass
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            return self._jitted(*args)  # called inside another program: part of its trace
        return self.prepare(*args)(*args)

    def prepare(self, *args: Any) -> Any:
        """The executable for ``args`` (arrays or ``jax.ShapeDtypeStruct``s), loaded or compiled
        now, and the one later calls try first."""
        sig = signature(args)
        executable = self._executables.get(sig)
        if executable is None:
            executable = self._store.executable(self._group, self._name, self._jitted, args)
            self._executables[sig] = executable
        self._last = executable
        return executable


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def signature(args: tuple) -> str:
    """What a compiled program requires of its arguments, as text: the tree, then each leaf's
    shape, dtype, weak type, sharding and devices (a Python scalar: its type alone, since a
    jitted function traces it as a weakly typed scalar)."""
    leaves, tree = jax.tree.flatten(args)
    return "|".join([str(tree), *map(_leaf, leaves)])


def _leaf(x: Any) -> str:
    if isinstance(x, (bool, int, float, complex)):
        return type(x).__name__
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return f"{type(x).__name__}:{x!r}"
    sharding = getattr(x, "sharding", None)
    ids = getattr(getattr(sharding, "mesh", None), "device_ids", None)
    devices = None if ids is None else ids.tolist()
    return f"{tuple(shape)}:{dtype}:{getattr(x, 'weak_type', False)}:{sharding!r}:{devices}"


def fingerprint() -> str:
    """This process's part of every key (see the module docstring)."""
    h = hashlib.sha256()
    for name in VERSIONED:
        h.update(f"{name}={_version(name)};".encode())
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    h.update(
        f"{jax.default_backend()}|{jax.devices()[0].client.platform_version}|{devices}".encode()
    )
    for var in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"):
        h.update(f"{var}={os.environ.get(var, '')};".encode())
    for setting in _JAX_SETTINGS:
        h.update(f"{setting}={getattr(jax.config, setting, None)};".encode())
    for path in _sources():
        h.update(str(path).encode())
        try:
            h.update(path.read_bytes())
        except OSError:  # a module whose file is gone (generated, deleted): its name stands
            h.update(b"-")
    return h.hexdigest()


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _sources() -> list[Path]:
    """Every file of this project's packages, and every loaded module's file that is neither
    an installed package's nor the standard library's (a user's own code)."""
    files: set[Path] = set()
    for top in _OWN:
        package = sys.modules.get(top)
        if package is not None and getattr(package, "__file__", None):
            files.update(Path(package.__file__).parent.rglob("*.py"))
    outside = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        installed = file and ("site-packages" in file or "dist-packages" in file)
        own_code = file and os.path.isabs(file) and file.endswith(".py")
        if own_code and not installed and not file.startswith(tuple(outside)):
            files.add(Path(file))
    return sorted(files)
