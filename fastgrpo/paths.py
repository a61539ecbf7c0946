"""The files a command reads and writes, checked the way a user needs: text that is not UTF-8 is named with its file and
line, and a place a command will write is checked writable before any model loads."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def read_text(path: Path) -> str:
    """The UTF-8 text of ``path``; ``ValueError`` naming the file, line and byte when it is not UTF-8 text (a binary
    file, or text saved in another encoding)."""
    return "".join(line for _, line in read_lines(path))


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The lines of the UTF-8 text file ``path`` (line ends kept), numbered from 1, read one at a time, without the
    byte-order mark some editors put at its start; ``ValueError`` naming the file, line, column and byte at the first
    line that is not UTF-8 text."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}, line {number}, column {e.start + 1}: not UTF-8 text (byte 0x{raw[e.start]:02x}); save "
                    "the file as UTF-8"
                ) from None


def unicode_problem(text: str) -> str | None:
    """Why ``text`` cannot be tokenized (it holds a lone surrogate, as invalid bytes in a command-line argument or a
    JSON ``\\ud800`` escape give), or None when it can."""
    for index, char in enumerate(text):
        if 0xD800 <= ord(char) <= 0xDFFF:
            return f"holds a lone surrogate (U+{ord(char):04X}) at character {index + 1}, which is not valid Unicode"
    return None


def expand_user(path: str | os.PathLike[str], what: str) -> str:
    """``path`` with a leading ``~`` or ``~user`` expanded, as a shell would; ``ValueError`` naming ``what`` when it
    names a user this system does not know (left as it is, it would create a directory called ``~user``)."""
    text = os.fspath(path)
    expanded = os.path.expanduser(text)
    if text.startswith("~") and expanded == text:
        user = text[1:].split("/", 1)[0]
        who = f"the user {user!r}" if user else "the home directory (HOME is not set)"
        raise ValueError(f"{what}: {text} starts with ~ but {who} is not known on this system")
    return expanded


def same_path(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether ``a`` and ``b`` name the same file or directory: the same path once links are resolved, or (both
    existing) the same file on disk (hard links too)."""
    real_a, real_b = os.path.realpath(os.path.expanduser(a)), os.path.realpath(os.path.expanduser(b))
    if real_a == real_b:
        return True
    try:
        return os.path.samefile(real_a, real_b)
    except OSError:
        return False


def check_not_an_input(output: str | os.PathLike[str], what: str, inputs: dict[str, str | None]) -> None:
    """Raise ``ValueError`` naming ``what`` when the file ``output`` a command writes is one of its existing
    ``inputs`` (by option name; None: not given), directly or through a link, or an existing file inside an input
    directory (a model's): writing it would replace what the command reads."""
    out = Path(os.path.realpath(os.path.expanduser(output)))
    for option, given in inputs.items():
        if given is None or not os.path.exists(os.path.expanduser(given)):
            continue  # a hub id, a preset's name: nothing on disk to replace
        source = Path(os.path.realpath(os.path.expanduser(given)))
        if same_path(out, source):
            raise ValueError(
                f"{what}: {output} is {option} {given} (the same path): writing it would replace what it reads; "
                f"choose another {what}"
            )
        if source.is_dir() and out.is_relative_to(source) and out.exists():
            raise ValueError(
                f"{what}: {output} is a file of {option} {given}: writing it would replace it; choose another {what}"
            )


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_dir(path: str | Path, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` when the directory ``path`` can neither be written nor created."""
    path = Path(path).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what}: {path} is a file, not a directory")
    existing = _nearest_existing(path)
    if not existing.is_dir():
        raise ValueError(f"{what}: {path} cannot be created: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: {path} cannot be written: {existing} is not writable by this user")


def check_writable_file(path: str | Path, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` when the file ``path`` cannot be written (its directory is created when
    missing, by whoever writes it)."""
    path = Path(path).expanduser().absolute()
    if path.is_dir():
        raise ValueError(f"{what}: {path} is a directory, not a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{what}: {path} cannot be written: the file is not writable by this user")
    check_writable_dir(path.parent, what)


def size_text(nbytes: float) -> str:
    """A number of bytes as a message shows it, in the largest of GiB, MiB and KiB it holds at least one of."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes / 2**10:.1f} KiB"


def free_bytes(path: str | Path) -> int:
    """The bytes free on the disk ``path`` is on (its nearest existing parent's, before it is created)."""
    return shutil.disk_usage(_nearest_existing(Path(path).expanduser().absolute())).free


def check_free_space(path: str | Path, needed: int, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` when the disk ``path`` is on has fewer than ``needed`` bytes free."""
    free = free_bytes(path)
    if needed > free:
        raise ValueError(
            f"{what}: {path} needs about {size_text(needed)}, more than the {size_text(free)} free on its disk; "
            f"make room there or choose another {what}"
        )


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it renamed into place, so that a process killed
    while writing leaves the old file or the new one, never part of either."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
