"""Attempts: which launch of a run's training job a checkpoint belongs to (inside the caller's
transaction).

A checkpoint is the parts of one attempt: ``(run, step, attempt)`` is its key, so parts of two
attempts are never combined. A launch resumes before it saves (``ckpt.resume.resume_point``, the
call a training script makes on start), so an attempt that recorded a resume is ordered by when
the catalog first heard of it (the ``attempts`` row's id). An attempt that never recorded one (a
job that does not call resume) is older than every attempt that resumed after its manifest was
written: a launch whose parts reach the catalog only after a relaunch resumed (its agent was
down, reconcile found its folders late) is the older one, however late it is heard of. The rules:

- When attempt B resumes from step S (``record_resume``), every checkpoint above S of an older
  attempt is *superseded by B*: recorded, audited, never offered for resume, ``latest``, drills
  or a default restore again, retired by retention once B has a durable checkpoint.
- A part of an older attempt arriving late (a slow promotion, reconcile finding an old folder) at
  a step above where a newer attempt resumed is recorded superseded at once (``standing``).
- A new attempt may save any step above where it resumed again, whatever its bytes; a step an
  older attempt holds that the new one did not resume from below is refused (``ConflictError``):
  a run name reused by mistake never supersedes a whole history.
- An attempt that never resumed, heard of after another attempt of the run, is refused at every
  step (``ConflictError``) unless it is an older launch arriving late: a run name reused by
  mistake never becomes the run's newest checkpoint, whatever step it saves. Which of the two it
  is comes from its manifest's ``created_at`` against the other attempt's first record (no time:
  refused); a clock that lies can only swap one refusal for the other (superseded, or refused),
  never make it live.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.engine import Connection, Row

from core.errors import ConflictError, ReusedRunName
from db.entities import CKPT_RETIRED, CKPT_SUPERSEDED
from db.models import Attempt
from db.rows import add_audit, checkpoints, insert_ignore

attempts = Attempt.__table__

FROM_SCRATCH = -1  # resumed_from_step of an attempt whose resume found no checkpoint


def attempt_row(conn: Connection, run_id: int, attempt: str, *, now: datetime) -> Row:
    """The attempt's row, recorded now (resumed from nowhere known) if the catalog had none."""
    insert_ignore(conn, attempts, dict(run_id=run_id, attempt=attempt, resumed_from_step=None, started_at=now),
                  ["run_id", "attempt"])
    return conn.execute(select(attempts).where(attempts.c.run_id == run_id, attempts.c.attempt == attempt)).one()


def record_resume(conn: Connection, run: Row, attempt: str, step: int | None, *, now: datetime,
                  actor: str) -> list[int]:
    """Attempt ``attempt`` of ``run`` resumes from ``step`` (None: from scratch); supersede the
    older attempts' checkpoints above it. Every rank of a launch calls this: the same call again
    is a no-op, and a rank that resumed from lower keeps the lower step (more is superseded,
    nothing combined). Returns the steps superseded now."""
    row = attempt_row(conn, run.id, attempt, now=now)
    resumed = FROM_SCRATCH if step is None else step
    if row.resumed_from_step is None or resumed < row.resumed_from_step:
        conn.execute(update(attempts).where(attempts.c.id == row.id).values(resumed_from_step=resumed))
        add_audit(conn, at=now, actor=actor, subject=f"attempt:{run.name}/{attempt}", action="resume",
                  reason="from scratch" if step is None else f"resumed from step {step}", run=run.name, step=step)
    return _supersede_above(conn, run, attempt, row.id, resumed, now=now, actor=actor)


def _supersede_above(conn: Connection, run: Row, attempt: str, attempt_id: int, step: int, *, now: datetime,
                     actor: str) -> list[int]:
    older = select(attempts.c.attempt).where(attempts.c.run_id == run.id, attempts.c.id < attempt_id)
    rows = conn.execute(select(checkpoints.c.id, checkpoints.c.step, checkpoints.c.state).where(
        checkpoints.c.run_id == run.id, checkpoints.c.step > step, checkpoints.c.attempt != attempt,
        checkpoints.c.state.not_in([CKPT_SUPERSEDED, CKPT_RETIRED]), checkpoints.c.attempt.in_(older))
        .order_by(checkpoints.c.step)).all()
    for r in rows:
        supersede(conn, run, r.id, r.step, r.state, by=attempt, now=now, actor=actor)
    return [r.step for r in rows]


def supersede(conn: Connection, run: Row, checkpoint_id: int, step: int, state: str, *, by: str, now: datetime,
              actor: str) -> None:
    conn.execute(update(checkpoints).where(checkpoints.c.id == checkpoint_id).values(
        state=CKPT_SUPERSEDED, superseded_by=by, superseded_at=now))
    add_audit(conn, at=now, actor=actor, subject=f"checkpoint:{run.name}/{step}", action="supersede",
              from_state=state, to_state=CKPT_SUPERSEDED, reason=f"superseded by attempt {by or '(unnamed)'}",
              run=run.name, step=step)


def standing(conn: Connection, run: Row, attempt: str, step: int, *, created: str = "", now: datetime,
             actor: str) -> str | None:
    """Before a new checkpoint ``(run, step, attempt)`` is recorded: the newer attempt that
    supersedes it at birth (a late part of an older attempt), or None when it is live. A live
    checkpoint of an older attempt at the same step is superseded here when this attempt
    resumed from below it (its resume call may have come before that checkpoint was recorded);
    otherwise this is a ``ConflictError``: the step belongs to another attempt's history.
    ``created``: the manifest's ``created_at``, which orders an attempt that never resumed."""
    me = attempt_row(conn, run.id, attempt, now=now)
    others = _others(conn, run.id, attempt)
    written = _when(created)
    for x in others:
        if x.resumed_from_step is not None and x.resumed_from_step < step and _launched_after(x, me, written):
            return str(x.attempt)
    reused = _reused(conn, run, me, attempt, others, written)
    if reused is not None:
        raise ReusedRunName(reused)
    clash = conn.execute(select(checkpoints.c.id, checkpoints.c.attempt, checkpoints.c.state).where(
        checkpoints.c.run_id == run.id, checkpoints.c.step == step, checkpoints.c.attempt != attempt,
        checkpoints.c.state.not_in([CKPT_SUPERSEDED, CKPT_RETIRED]))).all()
    for other in clash:
        if me.resumed_from_step is None or me.resumed_from_step >= step:
            raise ConflictError(
                f"step {step} of run {run.name!r} belongs to attempt {other.attempt or '(unnamed)'}, and attempt "
                f"{attempt or '(unnamed)'} did not resume from below it: is the run name reused by mistake? "
                f"Resume the run first (ckpt resume / ckpt.resume), or save under another run name")
        supersede(conn, run, other.id, step, other.state, by=attempt, now=now, actor=actor)
    return None


def refusal(conn: Connection, run: Row, attempt: str, *, created: str) -> str | None:
    """Why a checkpoint of ``attempt`` written at ``created`` would be refused whatever its step
    (a run name reused by mistake: see the module's rules), or None. Reads only: the training
    side asks it once, to stop a job whose every save the catalog will refuse."""
    me = conn.execute(select(attempts).where(attempts.c.run_id == run.id, attempts.c.attempt == attempt)).first()
    return _reused(conn, run, me, attempt, _others(conn, run.id, attempt), _when(created))


def _others(conn: Connection, run_id: int, attempt: str) -> list[Row]:
    return list(conn.execute(select(attempts).where(attempts.c.run_id == run_id, attempts.c.attempt != attempt)
                             .order_by(attempts.c.id)).all())


def _launched_after(x: Row, me: Row | None, written: datetime | None) -> bool:
    """Attempt ``x`` was launched after attempt ``me`` (None: not recorded yet), whose manifest
    was ``written`` then. An attempt that resumed is ordered by its first record; one that never
    did is older than every attempt first recorded after its manifest was written."""
    if me is not None and x.id > me.id:
        return True
    never_resumed = me is None or me.resumed_from_step is None
    return never_resumed and written is not None and written < _aware(x.started_at)


def _reused(conn: Connection, run: Row, me: Row | None, attempt: str, others: list[Row],
            written: datetime | None) -> str | None:
    """The refusal of an attempt that never resumed while the run has a history it did not
    resume from: an older attempt that resumed, or live checkpoints of an older attempt (every
    checkpoint's attempt has its row: revision 0011)."""
    if me is not None and me.resumed_from_step is not None:
        return None
    older = [x for x in others if not _launched_after(x, me, written)]
    if not older:
        return None
    who = next((str(x.attempt) for x in older if x.resumed_from_step is not None), None)
    if who is None:
        who = conn.execute(select(checkpoints.c.attempt).where(
            checkpoints.c.run_id == run.id, checkpoints.c.attempt.in_([x.attempt for x in older]),
            checkpoints.c.state.not_in([CKPT_SUPERSEDED, CKPT_RETIRED])).limit(1)).scalar()
    if who is None:
        return None
    return (f"attempt {attempt or '(unnamed)'} of run {run.name!r} never resumed, and the run already has a "
            f"history of attempt {who or '(unnamed)'}: is the run name reused by mistake? "
            f"Resume the run first (ckpt resume / ckpt.resume), or save under another run name")


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _when(created: str) -> datetime | None:
    """A manifest's ``created_at`` (validated ISO-8601), or None if it has none."""
    return _aware(datetime.fromisoformat(created)) if created else None
