"""ckpt-tiering's surface for people and training jobs: the ``ckpt`` CLI (cli, commands/), the
training-side client and its announcer, ``ckpt watch``, the demo and the local stack. The top
floor: it may import every other package (deployments, flows, tasks, db, core)."""
