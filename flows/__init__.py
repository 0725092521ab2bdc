"""Compositions of tasks (promote, archive, retention, reconcile, scrub, restore, drill) and their
Prefect ``@flow`` entry points, which take plain values only. Imports ``tasks``, ``db``, ``core``."""
