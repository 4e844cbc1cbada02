"""Learner checkpoints with orbax: one step directory per save, state + JSON metadata.

orbax writes each checkpoint into a temporary directory and renames it into place when it
is complete, so a crash mid-save leaves the previous checkpoint as the latest good one (the
unfinished directory is never listed or restored; the next save removes it).
orbax is imported lazily so that ``import storage`` stays light (it pulls in jax).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from .replay import StoreError


def _walk(tree: Any, path: str = ""):
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _walk(v, f"{path}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _walk(v, f"{path}/{i}")
    else:
        yield path or "/", tree


# errno -> what to do, for a checkpoint write that the file system refused
_WRITE_ERRNOS = {28: "free space there", 30: "remount it writable", 13: "make it writable",
                 122: "raise the disk quota"}


def _write_error(error: Exception, directory: str, step: int, latest: int | None) -> Exception:
    """A one-line StoreError for a save that failed for lack of space (or a read-only or
    unwritable directory); any other error unchanged."""
    import errno as errnos
    import re

    code = getattr(error, "errno", None)
    if code not in _WRITE_ERRNOS:
        found = re.search(r"os_error_code='(\d+)'", str(error))
        code = int(found.group(1)) if found else next(
            (n for n in _WRITE_ERRNOS if os.strerror(n) in str(error)), None)
    if code not in _WRITE_ERRNOS:
        return error
    kept = f"checkpoint {latest} is intact" if latest is not None else "no earlier checkpoint"
    return StoreError(f"checkpoint {step} could not be written to {directory}: {os.strerror(code)} "
                      f"({errnos.errorcode.get(code, code)}); {_WRITE_ERRNOS[code]} ({kept}), then run the "
                      f"same command to resume")


class Checkpointer:
    """Save and restore learner state (a pytree) plus JSON metadata under ``directory``."""

    def __init__(self, directory, max_to_keep: int = 3):
        import orbax.checkpoint as ocp

        if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise StoreError(f"max_to_keep must be a positive int, got {max_to_keep!r}")
        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise StoreError(f"checkpoint directory {self.directory} is a file; pass a directory")
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
            item_names=("state", "metadata"),
        )

    def save(
        self, step: int, state: dict, metadata: dict | None = None, wait: bool = True
    ) -> None:
        """Save `state` (pytree of arrays / python scalars) and JSON `metadata` as `step`.

        Saving the latest step again is a no-op (a retried task); an older step is an error.
        """
        ocp = self._ocp
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StoreError(f"checkpoint step must be an int >= 0, got {step!r}")
        metadata = {} if metadata is None else metadata
        try:
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise StoreError(
                f"checkpoint metadata is not JSON-serialisable ({e}); pass plain str/int/float/list/dict"
            ) from None
        for where, leaf in _walk(state):
            if str(getattr(leaf, "dtype", "")).startswith("key<"):
                raise StoreError(
                    f"state leaf {where} is a typed jax PRNG key; save jax.random.key_data(key) "
                    f"(uint32) and rebuild it with jax.random.wrap_key_data"
                )
        self._manager.wait_until_finished()
        latest = self._manager.latest_step()
        if latest is not None and step <= latest:
            if step == latest:
                return
            raise StoreError(
                f"checkpoint step {step} is older than the latest step {latest} in "
                f"{self.directory}; save with a step > {latest} or use a new directory"
            )
        self._check_space(step, state, latest)
        self._drop_unfinished()
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    metadata=ocp.args.JsonSave(metadata),
                ),
                force=True,
            )
            if wait:
                self._manager.wait_until_finished()
        except Exception as e:  # orbax/tensorstore wrap a full disk in ValueErrors of many lines
            one_line = _write_error(e, self.directory, step, latest)
            if one_line is e:
                raise
            raise one_line from None

    def _drop_unfinished(self) -> None:
        """Removes the step directories a killed save left unfinished (orbax's
        `<step>.orbax-checkpoint-tmp`): never listed nor restored, but they hold disk space
        and orbax warns on the terminal where it meets one. Done here, not on open: readers
        (`marl runs`, reanalysis) open checkpoints while the run's learner is saving, and
        this run's own saves have all finished (wait_until_finished above)."""
        import shutil

        for name in os.listdir(self.directory):
            if ".orbax-checkpoint-tmp" in name:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def _check_space(self, step: int, state: dict, latest: int | None) -> None:
        """A one-line StoreError before orbax writes anything where the file system lacks the
        room for the checkpoint (twice the state's bytes plus 1 MiB of metadata: orbax's own
        errors there are screens of tensorstore specs, and its threads print more)."""
        need = 2 * sum(int(getattr(leaf, "nbytes", 8)) for _, leaf in _walk(state)) + 2**20
        where = self.directory
        while not os.path.exists(where):
            where = os.path.dirname(where)
        stat = os.statvfs(where)
        free = stat.f_bavail * stat.f_frsize
        kept = f"checkpoint {latest} is intact" if latest is not None else "no earlier checkpoint"
        # refused before orbax starts: its threads wait minutes for a step directory that
        # cannot be made, then print their own tracebacks
        for code, refused in ((30, stat.f_flag & os.ST_RDONLY), (13, not os.access(where, os.W_OK))):
            if refused:
                raise _write_error(OSError(code, os.strerror(code)), self.directory, step, latest)
        if free < need:
            raise StoreError(f"checkpoint {step} could not be written to {self.directory}: No space left on "
                             f"device (ENOSPC: {free / 2**20:.1f} MiB free, it needs about {need / 2**20:.1f} "
                             f"MiB); free space there ({kept}), then run the same command to resume")

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def step_to_restore(self, step: int | None = None) -> int:
        """`step` where it is saved, the latest where None; else a one-line StoreError naming
        the saved steps."""
        self._manager.wait_until_finished()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise StoreError(
                    f"no checkpoint in {self.directory}; train first or point at a run dir "
                    f"that has checkpoints"
                )
            step = steps[-1]
        elif step not in steps:
            raise StoreError(
                f"no checkpoint for step {step} in {self.directory} (it has "
                f"{', '.join(map(str, steps)) or 'none'}); pass one of those (--checkpoint)"
            )
        return step

    def restore(self, step: int | None = None, target: dict | None = None) -> tuple[dict, dict]:
        """(state, metadata) of `step` (latest if None); `target` fixes structure and dtypes."""
        ocp = self._ocp
        step = self.step_to_restore(step)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target),
                metadata=ocp.args.JsonRestore(),
            ),
        )
        return restored.state, dict(restored.metadata or {})

    def metadata(self, step: int | None = None) -> dict:
        """The JSON metadata of `step` (latest if None), without reading the state."""
        step = self.step_to_restore(step)
        restored = self._manager.restore(
            step, args=self._ocp.args.Composite(metadata=self._ocp.args.JsonRestore()))
        return dict(restored.metadata or {})

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
