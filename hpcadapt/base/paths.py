"""Output paths checked before a run starts: a path the job could not write is refused with
one line at start, not found out at the first write or when the stop signal comes."""

from __future__ import annotations

import os
import tempfile

__all__ = ["unwritable"]


def unwritable(flag: str, path: str, *, folder_path: bool = False,
                replaced: bool = False) -> str:
    """Why ``path`` cannot be written (a one-line message naming ``flag``), or "". The file
    itself when it exists (opened for writing without following a link, creating or
    truncating nothing: a read-only file used to pass and fail at the job's end), then its
    folder (a probe file). ``folder_path``: ``path`` is a folder the job writes into;
    ``replaced``: the file is only ever renamed over (a checkpoint), so only its folder
    counts."""
    if os.path.islink(path) and not replaced:
        return (f"{flag} {path}: is a symbolic link, which hpcadapt does not write through; "
                f"pass the real path")
    if os.path.isdir(path) and not folder_path:
        return f"{flag} {path}: is a folder; pass a file path"
    if os.path.lexists(path) and folder_path and not os.path.isdir(path):
        return f"{flag} {path}: is not a folder; pass a folder path"
    if os.path.lexists(path) and not (folder_path or replaced):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
                             | os.O_CLOEXEC))
        except OSError as exc:
            return (f"{flag} {path}: the file cannot be written ({exc.strerror}); make it "
                    f"writable or pass another path")
    folder = os.path.abspath(path) if folder_path else os.path.dirname(os.path.abspath(path))
    while folder_path and not os.path.exists(folder):
        folder = os.path.dirname(folder)  # the folder that its missing ones are made in
    try:
        fd, probe = tempfile.mkstemp(prefix=".hpcadapt-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return (f"{flag} {path}: cannot write in {folder} ({exc.strerror}); pass a path in a "
                f"writable folder")
    return ""
