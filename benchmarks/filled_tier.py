"""A tier that holds what ``catalog_scale``'s fill recorded, without the bytes: an fsspec file
system (protocol ``ckptbench``) whose listings are computed from the fill's shape, so that
reconcile can run against a 1M-checkpoint catalog through its real code path (``open_store``,
``FsspecStore``) with every verified copy present on its tier.

``ckptbench://t1``: every run's steps but the newest two (the fill's Tier 1).
``ckptbench://t0``: Tier 0 of ``node-0``, the node the benchmark's reconcile runs as: the
third newest step of the runs whose Tier 0 copies are on it (run number % ``NODES`` == 0; the
fill puts the newest two, never promoted, on the Tier 0 of a node whose agent is down).
A (run, step) in ``FilledTier.vanished`` lists without its manifest: a copy deleted behind the
catalog's back. Only listings are served; nothing here can be read or written.
"""

from __future__ import annotations

import io
from typing import Any, ClassVar

from fsspec import AbstractFileSystem, register_implementation

from core.layout import SINGLE_MANIFEST, checkpoint_dirname, parse_step_dirname

NODES = 64  # the fill puts run r's Tier 0 copies on node-(r % NODES)


class FilledTier(AbstractFileSystem):
    protocol = "ckptbench"
    root_marker = ""
    cachable = False
    n_runs = 0
    steps = 100
    files = 8
    vanished: ClassVar[set[tuple[str, int]]] = set()
    blobs: ClassVar[dict[str, bytes]] = {}  # the few real files: each root's identity marker (and its staging)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return path.removeprefix("ckptbench://").strip("/")

    def _runs(self, tier: str) -> list[str]:
        return [f"run-{r:05d}" for r in range(self.n_runs) if tier == "t1" or r % NODES == 0]

    def _has_run(self, tier: str, name: str) -> bool:
        """``name in self._runs(tier)`` without building the list (10,000 names at 1M)."""
        r = int(name[4:]) if name.startswith("run-") and name[4:].isdigit() else -1
        return 0 <= r < self.n_runs and (tier == "t1" or r % NODES == 0)

    def _steps(self, tier: str) -> list[int]:
        idx = range(self.steps - 2) if tier == "t1" else range(self.steps - 3, self.steps - 2)
        return [(i + 1) * 10 for i in idx]

    def ls(self, path: str, detail: bool = True, **_: Any) -> list[Any]:
        segs = self._strip_protocol(path).split("/")
        tier = segs[0]
        if tier not in ("t0", "t1") or len(segs) > 3:
            raise FileNotFoundError(path)
        if len(segs) == 1:
            entries = [(f"{tier}/{r}", "directory", 0) for r in self._runs(tier)]
        elif len(segs) == 2:
            if not self._has_run(tier, segs[1]):
                raise FileNotFoundError(path)
            entries = [(f"{tier}/{segs[1]}/{checkpoint_dirname(s)}", "directory", 0) for s in self._steps(tier)]
        else:
            step = parse_step_dirname(segs[2])
            if not self._has_run(tier, segs[1]) or step not in self._steps(tier):
                raise FileNotFoundError(path)
            base = "/".join(segs)
            entries = [(f"{base}/model-{f:05d}.safetensors", "file", 2**30) for f in range(self.files)]
            if (segs[1], step) not in self.vanished:
                entries.append((f"{base}/{SINGLE_MANIFEST}", "file", 512))
        if not detail:
            return [name for name, _, _ in entries]
        return [{"name": name, "type": kind, "size": size} for name, kind, size in entries]


    # --- the real files beside the synthetic tree: a tier root's identity marker ---------------
    def isdir(self, path: str) -> bool:
        return self._strip_protocol(path) in ("t0", "t1") or super().isdir(path)

    def info(self, path: str, **kw: Any) -> dict[str, Any]:
        key = self._strip_protocol(path)
        if key in self.blobs:
            return {"name": key, "type": "file", "size": len(self.blobs[key])}
        return super().info(path, **kw)

    def _open(self, path: str, mode: str = "rb", **_: Any) -> Any:
        key = self._strip_protocol(path)
        if "r" in mode:
            if key not in self.blobs:
                raise FileNotFoundError(path)
            return io.BytesIO(self.blobs[key])
        blobs = self.blobs

        class Blob(io.BytesIO):
            def close(self) -> None:
                blobs[key] = self.getvalue()
                super().close()

        return Blob()

    def mv(self, path1: str, path2: str, **_: Any) -> None:
        self.blobs[self._strip_protocol(path2)] = self.blobs.pop(self._strip_protocol(path1))

    def rm(self, path: Any, recursive: bool = False, **_: Any) -> None:
        self.blobs.pop(self._strip_protocol(path), None)

    def rm_file(self, path: str) -> None:
        self.rm(path)


register_implementation("ckptbench", FilledTier, clobber=True)
