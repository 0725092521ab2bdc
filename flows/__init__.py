"""Compositions of tasks (promote, archive, retention, reconcile, scrub, restore, drill) and their
Prefect ``@flow`` entry points, which take plain values only. Imports ``tasks``, ``db``, ``core``.

Naming: a flow that wraps a step is ``<name>_flow`` (``scrub_flow``, ``restore_flow``,
``drill_flow``) and the plain step keeps the plain name (``tasks.scrub.scrub``), so one Python
name means one thing. Only the Python name follows this: the Prefect flow name
(``@flow(name=...)``) is what deployments, the UI and events see, and it does not change."""
