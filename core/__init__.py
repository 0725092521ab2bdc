"""The ground floor: errors, settings, layout rules, manifests and formats, checksums, tier
storage (one module per backend) and the transfer engine. Imports nothing above it (no db,
tasks, flows, deployments or ckpt); every other package may import it."""
