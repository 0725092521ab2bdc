"""How flows run: ``ckpt agent`` (``serve()`` with event triggers and cron schedules) and
``prefect.yaml``. The only package that knows triggers and schedules; imports ``flows`` and below."""
