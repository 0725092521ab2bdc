"""One unit of work each (register, verify, copy, prune, scrub, restore...): a plain function
over plain values plus a thin ``@task`` with the retry policy. Imports ``db`` and ``core`` only."""
