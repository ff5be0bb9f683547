"""Publishing a checkpoint: written under a temporary name next to its path, renamed to it once every part is written.

A reader (``fit(ckpt_path="last")``, ModelCheckpoint's ``last.ckpt``, a path the user passes) never finds an
incomplete checkpoint at a checkpoint's path: a save writes ``.<name>.partial`` in the same folder (a name that
ModelCheckpoint never takes for a checkpoint: no ``.ckpt`` at its end), and `publish` renames it to ``<name>`` once
the last part is written (in launched mode: every process's, DCP's own finish). A save killed before that leaves
the checkpoint at ``<name>`` as it was, and a ``.partial`` leftover that the next save to that path replaces.
A folder replaces a folder or a file in one step on Linux (``renameat2(RENAME_EXCHANGE)`` swaps the names, then
the old one goes); elsewhere the old one moves aside first (``.<name>.old``): a crash between the two renames
leaves the new one complete at ``.<name>.partial`` and nothing at ``<name>``."""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
from pathlib import Path

from lightning_pipe.weights.sources import PathLike

PARTIAL, OLD = ".partial", ".old"


def temporary_path(path: PathLike) -> Path:
    """Where a checkpoint for ``path`` is written before `publish`: ``.<name>.partial`` in the same folder (the same
    name in every process, so all write their parts into one place)."""
    final = Path(path)
    return final.with_name(f".{final.name}{PARTIAL}")


def is_local(path: PathLike) -> bool:
    """Whether ``path`` is on this machine's file system (a remote URL such as ``s3://`` cannot be renamed)."""
    return "://" not in os.fspath(path)


def clear(path: PathLike) -> None:
    """Remove whatever is at ``path`` (a file, a link or a folder); nothing if nothing is there."""
    target = Path(path)
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)


def prepare(path: PathLike) -> Path:
    """The temporary name for ``path``, emptied of what an earlier save that did not finish left there."""
    temporary = temporary_path(path)
    clear(temporary)
    temporary.parent.mkdir(parents=True, exist_ok=True)
    return temporary


def publish(temporary: PathLike, path: PathLike) -> None:
    """Make the complete checkpoint at ``temporary`` the one at ``path``, replacing what was there in one step."""
    source, final = Path(temporary), Path(path)
    if not source.exists():
        raise FileNotFoundError(f"the checkpoint written for {final} is not at {source}: nothing to publish")
    if not (final.exists() or final.is_symlink()):
        os.rename(source, final)
        return
    if final.is_symlink() or (source.is_file() and final.is_file()):
        os.replace(source, final)  # atomic for files and links
        return
    if _exchange(source, final):  # the new one at ``path``, the old one at ``temporary``
        clear(source)
        return
    aside = final.with_name(f".{final.name}{OLD}")
    clear(aside)
    os.rename(final, aside)
    os.rename(source, final)
    clear(aside)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system or
    its file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # a libc without renameat2 (glibc before 2.28)
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    return int(renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange)) == 0
