"""Where things live on every tier: the one owner of the key, prefix and manifest-name rules.

A checkpoint of run ``R`` at step ``S`` lives under ``<tier root>/R/step-<S>/`` with ``S`` zero-
padded to at least 8 digits (``step-00001200``; steps of 100,000,000 and above simply have more
digits, up to ``MAX_STEP``, the largest a catalog's BIGINT holds). A checkpoint written by a named
training attempt ``A`` (one launch of the job, see ``core.attempt``) lives under
``step-<S>@<A>/``: two attempts that save the same step never share a folder on any tier. A checkpoint written by N
nodes has N parts side by side in that folder, each with its own manifest, written last as the
part's commit marker: ``manifest.json`` for a single part,
``manifest.part-<i:05d>-of-<n:05d>.json`` otherwise. Files being written are staged under hidden
``.ckpt-staging-*`` names that no listing shows; what a claim deletes on a file system is first
moved into a hidden tombstone folder beside the checkpoint's, ``.ckpt-tomb-<claim token>-step-<S>``,
which no listing shows either.
"""

from __future__ import annotations

import os
import re
import uuid

from core.errors import BadInput, quoted
from core.paths import safe_run_name

STEP_DIGITS = 8
SINGLE_MANIFEST = "manifest.json"
STAGING_MARK = ".ckpt-staging-"
TOMB_MARK = ".ckpt-tomb-"
MAX_STEP = 2**63 - 1  # a signed 64-bit integer: what every catalog backend stores
MAX_PARTS = 99999  # five digits in a part's manifest name

MAX_ATTEMPT = 64  # characters of an attempt name
ATTEMPT_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_ATTEMPT = re.compile(f"^{ATTEMPT_PATTERN}$", re.ASCII)
_NUMBER = re.compile(r"-?[0-9]+")  # ASCII digits: not what int() also takes
# re.ASCII: a name's digits are ASCII ones (``\d`` alone also matches full-width digits, which int() reads)
_STEP_DIR = re.compile(f"^step-(?P<step>\\d{{8,}})(?:@(?P<attempt>{ATTEMPT_PATTERN}))?$", re.ASCII)
_MANIFEST = re.compile(r"^manifest(?:\.part-(?P<part>\d{5})-of-(?P<parts>\d{5}))?\.json$", re.ASCII)
_STAGING = re.compile(r"^" + re.escape(STAGING_MARK) + r"(?P<pid>\d+)-[0-9a-f]{8}-.", re.ASCII)
_MANIFEST_KEY = re.compile(
    r"^(?P<run>[^/]+)/(?P<dir>step-[^/]+)/manifest(?:\.part-(?P<part>\d{5})-of-(?P<parts>\d{5}))?\.json$",
    re.ASCII)


def check_ref(step: int, part: int = 0, parts: int = 1) -> None:
    """``BadInput`` (one line, naming the bound) unless ``step`` is in ``0..MAX_STEP`` and
    ``part`` in ``0..parts-1`` with ``parts`` in ``1..MAX_PARTS``: the one range rule for every
    way a checkpoint is named (manifest, event, folder, CLI)."""
    if not 0 <= step <= MAX_STEP:
        raise BadInput(f"step {step} is out of range: a step is 0..{MAX_STEP} (2**63-1)")
    if not 1 <= parts <= MAX_PARTS:
        raise BadInput(f"parts {parts} is out of range: a checkpoint has 1..{MAX_PARTS} parts")
    if not 0 <= part < parts:
        raise BadInput(f"part {part} is out of range: part of {parts} is 0..{parts - 1}")


def check_attempt(attempt: str) -> str:
    """``attempt`` when it is a valid attempt name ('' is the unnamed attempt): up to
    ``MAX_ATTEMPT`` letters, digits, ``.``, ``_`` and ``-``, starting with a letter or digit;
    ``BadInput`` otherwise."""
    if attempt and not _ATTEMPT.match(attempt):
        raise BadInput(f"invalid attempt {attempt[:80]!r}: an attempt is 1..{MAX_ATTEMPT} of A-Z a-z 0-9 . _ - "
                       "starting with a letter or digit")
    return attempt


def parse_number(value: object, what: str = "step") -> int:
    """A step, part or part count as it arrives from outside (an event's text, a CLI argument,
    a JSON number): an ``int`` as it is, text only when it is ASCII digits (a leading ``-`` is
    read, for ``check_ref`` to refuse as out of range). ``BadInput`` otherwise: ``int()`` alone
    would take ``'1_00'``, ``'100\\n'`` or full-width digits as 100. The one parser for
    every place a checkpoint reference arrives as text."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _NUMBER.fullmatch(value):
        if len(value) > 40:  # past any bound, and past what int() converts from text at all
            raise BadInput(f"{what} {quoted(value)} is out of range")
        return int(value)
    raise BadInput(f"{what} {quoted(value)} is not a number: use ASCII digits only")


def parse_ref(step: object, part: object = 0, parts: object = 1) -> tuple[int, int, int]:
    """``(step, part, parts)`` parsed (``parse_number``) and in range (``check_ref``)."""
    ref = parse_number(step), parse_number(part, "part"), parse_number(parts, "parts")
    check_ref(*ref)
    return ref


def checkpoint_dirname(step: int, attempt: str = "") -> str:
    """Folder (or key prefix) of a checkpoint under ``<tier root>/<run>/``."""
    name = f"step-{step:0{STEP_DIGITS}d}"
    return f"{name}@{check_attempt(attempt)}" if attempt else name


def parse_checkpoint_dirname(name: str) -> tuple[int, str] | None:
    """``(step, attempt)`` a checkpoint folder name stands for, or None when ``name`` is not
    exactly what ``checkpoint_dirname`` writes (``step-12`` or ``step-012345678`` are not ours).
    A step past ``MAX_STEP`` is returned as it is: the folder is ours by its name, and whoever
    acts on it refuses it with ``check_ref`` (reported, left alone) rather than overlooking it."""
    m = _STEP_DIR.match(name)
    if m is None:
        return None
    step, attempt = int(m["step"]), m["attempt"] or ""
    return (step, attempt) if checkpoint_dirname(step, attempt) == name else None


def parse_step_dirname(name: str) -> int | None:
    """The step of a checkpoint folder name (``parse_checkpoint_dirname``), whatever its attempt."""
    parsed = parse_checkpoint_dirname(name)
    return None if parsed is None else parsed[0]


def checkpoint_prefix(run: str, step: int, attempt: str = "") -> str:
    """Key prefix of a checkpoint relative to the tier root (the run name is confined)."""
    return f"{safe_run_name(run)}/{checkpoint_dirname(step, attempt)}"


def manifest_name(part: int = 0, parts: int = 1) -> str:
    """The file name of a part's manifest inside the checkpoint folder."""
    if parts == 1:
        return SINGLE_MANIFEST
    return f"manifest.part-{part:05d}-of-{parts:05d}.json"


def is_manifest_name(name: str) -> bool:
    return _MANIFEST.match(name) is not None


def part_key(run: str, step: int, part: int = 0, parts: int = 1, attempt: str = "") -> str:
    """Key of a part's manifest (its commit marker) relative to the tier root."""
    return f"{checkpoint_prefix(run, step, attempt)}/{manifest_name(part, parts)}"


def parse_manifest_key(key: str) -> tuple[str, int, int, int, str] | None:
    """``(run, step, part, parts, attempt)`` of a manifest key, or None when ``key`` is not one."""
    m = _MANIFEST_KEY.match(key)
    parsed = parse_checkpoint_dirname(m["dir"]) if m else None
    if not m or parsed is None:
        return None
    part, parts = (int(m["part"]), int(m["parts"])) if m["part"] else (0, 1)
    return m["run"], parsed[0], part, parts, parsed[1]


def staging_name(name: str) -> str:
    """A fresh hidden name beside ``name`` for bytes not yet checked and published."""
    return f"{STAGING_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}"


def is_staging(name: str) -> bool:
    return name.startswith(STAGING_MARK)


def staging_pid(name: str) -> int | None:
    """The id of the process that made the staging name ``name`` (``staging_name``), or None
    when ``name`` is not one."""
    m = _STAGING.match(name)
    return int(m["pid"]) if m else None
def tomb_name(token: str, name: str) -> str:
    """The hidden name beside ``name`` that the claim ``token`` moves what it deletes to."""
    if not token or not token.isalnum():
        raise BadInput(f"claim token {token!r}: a tombstone's token is letters and digits")
    return f"{TOMB_MARK}{token}-{name}"


def tomb_token(name: str) -> str | None:
    """The claim token a tombstone's name carries (``tomb_name``), None when ``name`` is none."""
    if not name.startswith(TOMB_MARK):
        return None
    token, sep, _rest = name[len(TOMB_MARK):].partition("-")
    return token if sep and token.isalnum() else None


def is_tomb(name: str) -> bool:
    return name.startswith(TOMB_MARK)
