"""ckpt-tiering: keep training checkpoints safe across storage tiers."""
