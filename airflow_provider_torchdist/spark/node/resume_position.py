"""Exact resume: where each rank is in its data, and its random generators, saved with every
checkpoint and restored on load, with no code of the user's.

``rank_batches(batch_size, epoch=e)`` notes here how many batches of which epoch it has handed out
(:func:`note_position`). ``save_checkpoint``, which every rank calls after the step that used the
batch, writes this rank's position and generator states (:mod:`.rng_states`) whole, as one small
JSON object: ``<checkpoint_dir>/positions/<step prefix>/rank-<RANK>.json`` (one PUT remotely, a
private file renamed into place locally). ``load_latest_checkpoint()`` reads it back, sets the
generators and a resume point, and ``rank_batches(..., epoch=e)`` then yields nothing for the
epochs already trained and skips exactly the batches already trained of the partial one
(:func:`batches_to_skip`).

Any executor of the run can write the store, so a position is read with a size bound and checked
field by field (never unpickled). One that is missing or malformed gives a one-line warning on its
rank and today's behaviour (epochs from their first batch). When the world size changed, or a rank
of the same world saved no position (it stopped before writing it), every rank sees the same files
and starts the partial epoch over from its first batch (the epochs before it are still skipped).

Runs in the ranks: imports no Airflow; torch and NumPy only when called.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

from airflow_provider_torchdist.spark.node.checkpoint_files import make_private_dir
from airflow_provider_torchdist.spark.node.checkpoint_io import StoreObjects
from airflow_provider_torchdist.spark.node.checkpoint_manifest import Manifest, Settings, step_dir
from airflow_provider_torchdist.spark.node.rng_states import capture_rng, checked_rng, restore_rng

#: The store's prefix for positions: beside the step prefixes, never listed as one.
POSITIONS = "positions"
FORMAT = "torchdist-position/1"
#: The most of a position file that is read: a real one is about 20 KB (the generators' states).
MAX_POSITION_BYTES = 256 * 1024
RANK_FILE = re.compile(r"^rank-(\d{1,7})\.json$")
#: Bounds on the numbers a position may hold (far beyond any real run; no giant integers).
MAX_COUNT = 2**53


@dataclass(frozen=True)
class Position:
    """Where a rank is in its data: ``batches`` of epoch ``epoch`` handed out (trained, when saved
    after the step), with what makes the count mean the same rows again."""

    epoch: int
    batches: int
    batch_size: int
    drop_last: bool
    rows: int  # this rank's rows of train_data
    seed: int | None  # train_data_shuffle_seed


@dataclass(frozen=True)
class Resume:
    """Where this rank resumes: epochs before ``epoch`` are done; of ``epoch``, ``batches`` are,
    when ``recorded`` (the position saved) still describes the same data, else none."""

    epoch: int
    batches: int
    recorded: Position | None


#: What rank_batches(epoch=) has handed out in this process, and where load says to resume.
_current: Position | None = None
_resume: Resume | None = None


def note_position(position: Position) -> None:
    """Record ``position`` as this rank's (``rank_batches`` calls it as it hands out a batch)."""
    global _current
    _current = position


def batches_to_skip(here: Position, total: int) -> int:
    """How many of epoch ``here.epoch``'s ``total`` batches were trained before the resume: all of
    an earlier epoch, the recorded count of the partial one, none after it. Once the partial
    epoch starts, the resume point is spent."""
    global _resume
    resume = _resume
    if resume is None or here.epoch > resume.epoch:
        _resume = None
        return 0
    if here.epoch < resume.epoch:
        return total
    _resume = None
    recorded = resume.recorded
    if recorded is None or resume.batches == 0:
        return 0
    if replace(recorded, batches=0) != replace(here, batches=0):
        _warn(
            f"epoch {here.epoch} starts over from its first batch: its position was saved with "
            f"{_settings(recorded)}, this loop has {_settings(here)}"
        )
        return 0
    return min(resume.batches, total)


def _settings(p: Position) -> str:
    return f"batch_size={p.batch_size}, drop_last={p.drop_last}, {p.rows} rows, shuffle seed {p.seed}"


def _warn(message: str) -> None:
    print(f"torchdist checkpoints: rank {_rank()}: {message}", file=sys.stderr, flush=True)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _folder(store: StoreObjects, step: int, run: dict[str, Any] | None) -> str:
    return store.join(POSITIONS, step_dir(step, run))


# -- saving ------------------------------------------------------------------------------------


def capture_position(step: int) -> bytes:
    """This rank's position and generator states now, as step ``step``'s record (JSON): taken when
    ``save_checkpoint`` is called, written by :func:`write_position` (later, for an asynchronous save)."""
    body = {
        "format": FORMAT,
        "step": int(step),
        "rank": _rank(),
        "world_size": _world_size(),
        "position": None if _current is None else asdict(_current),
        "rng": capture_rng(),
    }
    return json.dumps(body).encode()


def write_position(store: StoreObjects, step: int, record: bytes) -> None:
    """Write this rank's ``record`` (:func:`capture_position`) as step ``step``'s, whole."""
    folder = _folder(store, step, Settings.from_env().run)
    if store.fs is None:
        os.makedirs(store.root, mode=0o700, exist_ok=True)
        make_private_dir(store.join(POSITIONS))  # refused when planted as a symlink
        make_private_dir(folder)
    store.write_whole(f"{folder}/rank-{_rank()}.json", record)


def delete_positions(store: StoreObjects, manifest: Manifest) -> None:
    """Remove the positions of ``manifest``'s step (retention); a planted symlink is not followed."""
    folder = _folder(store, manifest.step, manifest.run)
    if store.fs is not None:
        for name in _rank_names(store, folder):
            store.remove(f"{folder}/{name}")
        return
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return  # none saved, or not a directory of its own: nothing of ours
    try:
        for name in os.listdir(fd):
            if RANK_FILE.match(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(folder)


# -- restoring ---------------------------------------------------------------------------------


def _rank_names(store: StoreObjects, folder: str) -> list[str]:
    if store.fs is None:
        try:
            if not stat.S_ISDIR(os.lstat(folder).st_mode):
                raise ValueError(f"{folder} is not a directory of its own (a symlink?)")
            return [n for n in os.listdir(folder) if RANK_FILE.match(n)]
        except FileNotFoundError:
            return []
    store.fs.invalidate_cache()
    try:
        found = store.fs.ls(folder, detail=False)
    except FileNotFoundError:
        return []
    return [n for n in (p.rstrip("/").rsplit("/", 1)[-1] for p in found) if RANK_FILE.match(n)]


def _count(value: Any, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_COUNT:
        raise ValueError(f"{what} must be an integer in [{low}, 2**53], got {str(value)[:40]!r}")
    return value


def checked_position(data: bytes, rank: int, step: int) -> tuple[int, Position | None, Any]:
    """A position file's ``(world size, position, checked generator states)``; ``ValueError``
    naming the first field that is wrong."""
    body = json.loads(data)
    keys = {"format", "step", "rank", "world_size", "position", "rng"}
    if not isinstance(body, dict) or set(body) != keys or body["format"] != FORMAT:
        raise ValueError(f"not a {FORMAT} object with the fields {sorted(keys)}")
    if _count(body["rank"], "rank") != rank or _count(body["step"], "step") != step:
        raise ValueError(f"it names rank {body['rank']}, step {body['step']}: copied from another file")
    world = _count(body["world_size"], "world_size", low=1)
    position = body["position"]
    if position is not None:
        fields = {"epoch", "batches", "batch_size", "drop_last", "rows", "seed"}
        if not isinstance(position, dict) or set(position) != fields:
            raise ValueError(f"position must be an object with the fields {sorted(fields)}")
        if not isinstance(position["drop_last"], bool):
            raise ValueError("position.drop_last must be true or false")
        seed = position["seed"]
        position = Position(
            epoch=_count(position["epoch"], "position.epoch"),
            batches=_count(position["batches"], "position.batches"),
            batch_size=_count(position["batch_size"], "position.batch_size", low=1),
            drop_last=position["drop_last"],
            rows=_count(position["rows"], "position.rows"),
            seed=None if seed is None else _count(seed, "position.seed"),
        )
    return world, position, checked_rng(body["rng"])


def restore_position(store: StoreObjects, manifest: Manifest) -> None:
    """Set this rank's generators and resume point from ``manifest``'s step, when it is this DAG
    run's (another run's data may be other rows); a one-line warning when it cannot be exact."""
    global _resume
    _resume = None
    if (manifest.run or None) != (Settings.from_env().run or None):
        return
    rank, world = _rank(), _world_size()
    own = f"rank-{rank}.json"
    folder = _folder(store, manifest.step, manifest.run)
    try:
        names = _rank_names(store, folder)
        if not names:
            return  # saved without positions (an older version, a framework's callback): as before
        # Another rank's, when this one saved none: its world size and epoch are every rank's.
        mine = own if own in names else min(names, key=lambda n: int(n[5:-5]))
        saved_world, position, states = checked_position(
            store.read_at_most(f"{folder}/{mine}", MAX_POSITION_BYTES), int(mine[5:-5]), manifest.step
        )
    except (OSError, ValueError, TypeError, RecursionError) as exc:  # RecursionError: planted nesting
        _warn(f"no exact resume: the data position saved at step {manifest.step} is refused ({exc})")
        return
    missing = [r for r in range(world) if f"rank-{r}.json" not in names]
    if saved_world != world or missing:
        if position is not None:
            _resume = Resume(position.epoch, 0, None)
        why = (
            f"the world size changed from {saved_world} to {world} (the data is dealt anew)"
            if saved_world != world
            else f"rank(s) {missing} saved no data position at step {manifest.step}"
        )
        if mine != own or saved_world != world:  # another rank's generators are not this one's
            _warn(f"no exact resume: {why}; {_epoch_over(position)}; the random generators are not restored")
            return
        _warn(f"no exact resume: {why}; {_epoch_over(position)}")
    if (why := _restore_states(states)) is not None:
        _warn(why)
    if position is not None and not missing:
        _resume = Resume(position.epoch, position.batches, position)


def _epoch_over(position: Position | None) -> str:
    if position is None:
        return "rank_batches(epoch=) was not used"
    return f"epoch {position.epoch} starts over from its first batch (the ones before it are skipped)"


def _restore_states(states: Any) -> str | None:
    try:
        return restore_rng(states)
    except (RuntimeError, ValueError) as exc:  # a state torch or NumPy refuses
        return f"the random generators saved are refused ({exc}); they are not restored"
