"""One typed settings object, read once at the edge (CLI command, flow entry, agent start).

Sources, highest first: explicit keyword arguments, ``CKPT_*`` environment variables, a
``ckpt.toml`` file (``CKPT_CONFIG`` or ``./ckpt.toml``), the embedded defaults. The embedded
defaults put every tier and the catalog under ``data_dir`` (``./.ckpt-data``) so that the demo
and the tests run with nothing configured; Tier 2 is off unless ``tier2_url`` is set.

Nested policies use ``__`` in environment names, e.g. ``CKPT_RETENTION_TIER0__KEEP_LAST=3``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from core.errors import BadInput, ConfigError


class RetentionPolicy(BaseModel):
    """What one tier keeps (``core.retention`` applies it; the README's table says what each
    tier keeps). A checkpoint is kept on the tier if *any* keep rule holds; pins, aliases, the
    newest verified checkpoint and lineage parents always keep. A copy no rule keeps is demoted
    (only while a copy at least as durable protects it); a checkpoint no tier keeps is retired."""

    keep_last: int | None = Field(default=None, ge=1, description="keep the newest N checkpoints of each run")
    keep_milestones: bool = Field(
        default=True, description="keep milestones on Tier 1 until archived (Tier 2 on) or for good (Tier 2 "
                                  "off); no effect on Tier 0 (scratch: a milestone leaves it once durable, like any "
                                  "checkpoint) or Tier 2")
    top_k: int | None = Field(default=None, ge=1, description="keep the best k by `metric`")
    metric: str | None = Field(default=None, description="metric name for top_k, e.g. 'loss'")
    metric_mode: Literal["min", "max"] = Field(default="min",
                                               description="best top_k: the lowest (min) or the highest (max)")
    max_age_days: float | None = Field(default=None, gt=0, description="keep checkpoints younger than this")
    enabled: bool = Field(default=True, description="off: this tier keeps everything it holds")
    max_bytes: int | None = Field(
        default=None, ge=1,
        description="the most this tier holds ('2TB', '500GiB' or bytes; on Tier 0 per node): what its policy "
                    "keeps only as 'retention off' goes oldest first beyond it; what a rule keeps never goes for "
                    "it, and a tier whose rules keep more raises ckpt.tier.over_budget")

    @field_validator("keep_last", "top_k", "metric", "max_age_days", mode="before")
    @classmethod
    def _none_unsets(cls, v: object) -> object:
        """'none' or blank (from the environment or ckpt.toml, which have no null) unsets a rule
        the tier's default policy has, e.g. ``CKPT_RETENTION_TIER1__KEEP_LAST=none``."""
        return None if isinstance(v, str) and v.strip().lower() in ("", "none") else v

    @field_validator("max_bytes", mode="before")
    @classmethod
    def _human_size(cls, v: object) -> object:
        """'2TB' (decimal), '500GiB' (binary) or a plain number of bytes; blank is unset. A
        non-finite or fractional-byte figure is refused, never rounded to a budget of nothing."""
        import math

        from core.sizing import parse_size  # deferred: start-up — only a budget given as text needs it

        if v is None or (isinstance(v, str) and not v.strip()):
            return None
        if isinstance(v, bool):
            raise ValueError(f"a size in bytes, not {v!r}")
        try:
            size = parse_size(v) if isinstance(v, str) else float(v)  # type: ignore[arg-type]
        except (BadInput, TypeError, ValueError) as exc:
            raise ValueError(str(exc) if isinstance(exc, BadInput) else f"a size in bytes, not {v!r}") from None
        if not math.isfinite(size) or size < 1:
            raise ValueError(f"must be a finite size of at least 1 byte, got {v!r}")
        return int(size)

    @property
    def lets_go(self) -> bool:
        """Whether retention may let anything go on this tier: on, or off under a budget."""
        return self.enabled or self.max_bytes is not None


class MilestonePolicy(BaseModel):
    """Which checkpoints are milestones (archived to Tier 2): every K steps, epoch ends, tagged."""

    every_steps: int | None = Field(default=None, ge=1, description="every K-th step is a milestone")
    epoch_end: bool = Field(default=True, description="a save at an epoch end is a milestone")
    tagged: bool = Field(default=True, description="a save the job tags (milestone=True) is a milestone")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CKPT_",
        env_nested_delimiter="__",
        extra="ignore",
        validate_default=True,
    )

    data_dir: Path = Field(default=Path(".ckpt-data"), description="root of the embedded defaults")
    tier0_url: str = Field(default="", description="node-local NVMe root (fsspec URL or path); "
                                                   "default data_dir/tier0/<node>")
    tier1_url: str = Field(default="", description="shared parallel FS root (fsspec URL or path); "
                                                   "default data_dir/tier1")
    tier2_url: str | None = Field(default=None, description="object store root, s3://bucket/prefix; unset = no Tier 2")
    s3_endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint (MinIO, moto)")
    s3_region: str = Field(default="us-east-1", description="the S3 region")
    tier2_lock_days: float | None = Field(
        default=None, gt=0,
        description="write Tier 2 copies under S3 Object Lock for this many days (the bucket must have been "
                    "created with Object Lock enabled); unset = no lock")
    tier2_lock_mode: Literal["governance", "compliance"] = Field(
        default="governance",
        description="Object Lock mode: governance (a principal with s3:BypassGovernanceRetention may still "
                    "delete) or compliance (nobody can delete or shorten it before its date, not even root)")
    catalog_url: str = Field(default="", description="SQLAlchemy URL; default SQLite in data_dir")
    node: str = Field(default_factory=socket.gethostname, description="this node's label (Tier 0 owner)")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="the least severe of the agent's own log lines it writes (stderr): INFO shows "
        "each part it promotes, each event it rejects, the runs it starts; Prefect's own lines keep Prefect's level")

    checksum_algorithm: Literal["crc32c"] = Field(default="crc32c",
                                                  description="the manifests' checksum (CRC32C, as S3 checks it)")
    copy_parallelism: int = Field(default=4, ge=1, le=64, description="files copied at once per part")
    io_buffer_bytes: int = Field(default=4 * 1024 * 1024, ge=64 * 1024, le=64 * 1024 * 1024,
                                 description="buffer per stream (the default is the fastest measured)")
    copy_nice: int = Field(default=10, ge=0, le=19, description="niceness the agent's copy and verify worker "
                           "threads take on (0: the agent's own), so a training job on the node keeps its cores")
    copy_io_class: Literal["idle", "best-effort", "unchanged"] = Field(
        default="best-effort", description="I/O priority of those threads: 'best-effort' at its lowest level (7), "
        "'idle' only when the disk is otherwise idle, 'unchanged' the agent's own (BFQ honours classes; "
        "mq-deadline only the class)")
    tier1_direct_io: bool = Field(
        default=False, description="Tier 1's bulk writes and reads (a promotion's copy into it and its read-back, "
        "verifies and scrubs of Tier 1) bypass the page cache (O_DIRECT): less CPU per byte, no page "
        "cache filled on the node, and the read-back reads what the storage holds, at the cost of that read; "
        "buffered where the file system refuses it")
    s3_multipart_threshold: int = Field(default=64 * 1024 * 1024, ge=5 * 1024 * 1024,
                                        description="Tier 2 uploads this large or larger are multipart")
    s3_multipart_chunksize: int = Field(default=64 * 1024 * 1024, ge=5 * 1024 * 1024,
                                        description="a multipart upload's part size (raised past 10,000 parts)")
    s3_max_concurrency: int = Field(default=8, ge=1, le=64, description="S3 requests in flight per file")
    s3_range_bytes: int = Field(default=8 * 1024 * 1024, ge=4096,
                                description="one ranged GET of a Tier 2 fetch (AWS's guidance: 8-16 MiB)")
    s3_ranged_threshold: int = Field(default=16 * 1024 * 1024, ge=4096,
                                     description="objects this large or larger are fetched as parallel ranged GETs")
    task_retries: int = Field(default=4, ge=0, le=20, description="retries of a pipeline task on transient errors")
    task_retry_delay_seconds: float = Field(default=2.0, ge=0, description="first retry delay; doubles, with jitter")
    part_scan_seconds: float = Field(
        default=10.0, ge=1.0,
        description="how often the agent lists its Tier 0 for committed parts no event brought (the event stream "
                    "is best effort); a part two scans in a row found is promoted: lower, a lost event's part is "
                    "promoted sooner; higher, fewer listings of a large Tier 0 (each lists every checkpoint there)")

    milestones: MilestonePolicy = Field(default=MilestonePolicy(),
                                        description="which checkpoints are milestones (archived to Tier 2)")
    retention_tier0: RetentionPolicy = Field(default=RetentionPolicy(keep_last=3),
                                             description="what Tier 0 (node NVMe, scratch) keeps")
    retention_tier1: RetentionPolicy = Field(default=RetentionPolicy(keep_last=10),
                                             description="what Tier 1 (the shared file system) keeps")
    retention_tier2: RetentionPolicy = Field(default=RetentionPolicy(enabled=False),
                                             description="what Tier 2 (object storage) keeps; off: everything")
    retention_keep_parents: bool = Field(
        default=True,
        description="a checkpoint another run resumed, fine-tuned or branched from keeps a verified copy on a "
                    "durable tier while that run has any checkpoint")

    tier0_price_gb_month: float = Field(
        default=0.0, ge=0, allow_inf_nan=False,
        description="what a GB-month on Tier 0 costs (ckpt tiers, the status page): node NVMe is already paid "
                    "for with the node, so 0")
    tier1_price_gb_month: float = Field(
        default=0.14, ge=0, allow_inf_nan=False,
        description="what a GB-month on Tier 1 costs: about a managed parallel file system's list price")
    tier2_price_gb_month: float = Field(
        default=0.023, ge=0, allow_inf_nan=False,
        description="what a GB-month on Tier 2 costs: S3 Standard's list price (first 50 TB, us-east-1)")

    prefect_api_url: str | None = Field(default=None, description="Prefect API; else Prefect's own setting")
    reconcile_interval_seconds: int = Field(default=60, ge=5, description="how often each agent's reconcile pass runs")
    reconcile_check_limit: int = Field(
        default=2000, ge=1,
        description="verified copies per tier that one reconcile pass checks are still on their tier (the next "
                    "pass goes on where it stopped, so every copy is checked in rotation)")
    audit_retain_days: float = Field(
        default=90, ge=0,
        description="audit rows older than this are exported (gzip'd JSON lines) and then deleted from the "
                    "catalog by the scheduled retention; 0 keeps them forever")
    audit_export_dir: Path | None = Field(default=None, description="where expired audit rows are exported; "
                                                                      "default <data_dir>/audit-export")
    rpo_seconds: int = Field(
        default=900, ge=10,
        description="recovery point objective: a checkpoint completed but not durable (every part on Tier 1) "
                    "this long after its first part's event raises ckpt.checkpoint.late (the RPO automation; Prefect's "
                    "proactive triggers need at least 10 s)")
    prune_evidence: Literal["read", "stat"] = Field(
        default="read",
        description="how a prune checks the copy that justifies it: 'read' reads its bytes back (a same-size "
                    "bit flip scrub has not reached yet is found), 'stat' checks presence and sizes only while "
                    "two or more other copies at least as durable are verified; a prune that would leave one "
                    "reads it back whatever this says")
    claim_lease_seconds: float = Field(
        default=120.0, gt=0,
        description="lease of a claimed copy or prune; renewed every fifth of it while the worker lives",
    )
    copy_stall_seconds: float = Field(
        default=600.0, ge=10,
        description="a claimed copy, verify or restore in which no byte moved for this long is stalled (its "
                    "storage stopped answering): its lease is no longer renewed, so the part is tried again once "
                    "the lease lapses, and the agent kills the process of a promotion that stalled (a part's, or its "
                    "checkpoint's run)",
    )
    tier0_space_wait_seconds: float = Field(
        default=60.0, ge=0,
        description="a save that finds too little free space on Tier 0 runs this node's Tier 0 retention and "
                    "waits up to this long (retention again every few seconds, as promotions make copies "
                    "droppable) before it raises StorageFull, having written nothing; 0: one retention pass, "
                    "no wait")
    tier_low_headroom_checkpoints: float = Field(
        default=3.0, ge=0,
        description="when a tier's free space after a save falls below this many checkpoints of that size, "
                    "a warning is logged and ckpt.tier.low is emitted (once per crossing, not per save); 0: off")
    retention_cron: str = Field(default="*/15 * * * *", description="when the cluster-wide retention runs (cron)")
    scrub_cron: str = Field(default="0 3 * * *", description="when scrub re-reads stored copies (cron)")
    scrub_fraction: float = Field(default=0.1, gt=0, le=1, description="the share of stored copies one scrub re-reads")
    drill_cron: str = Field(default="0 4 * * 0", description="when the recovery drill runs (cron)")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_path = os.environ.get("CKPT_CONFIG", "ckpt.toml")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if Path(toml_path).is_file():
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        sources.append(_TierPolicyDefaults(settings_cls))
        return tuple(sources)

    @field_validator("tier0_url", "tier1_url", "catalog_url", mode="before")
    @classmethod
    def _unset_is_default(cls, v: object) -> object:
        return "" if v is None else v  # None, like "", means the default that _fill_defaults puts in

    @field_validator("tier2_lock_mode", mode="before")
    @classmethod
    def _lower_mode(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v

    @field_validator("tier2_url")
    @classmethod
    def _tier2_is_an_object_store(cls, v: str | None) -> str | None:
        if v and (problem := tier2_url_problem(v)):
            raise ValueError(problem)
        return v or None

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        base = self.data_dir.expanduser().absolute()
        if not self.tier0_url:
            self.tier0_url = str(base / "tier0" / self.node)
        if not self.tier1_url:
            self.tier1_url = str(base / "tier1")
        if not self.catalog_url:
            self.catalog_url = f"sqlite:///{base / 'catalog.db'}"
        if self.audit_export_dir is None:
            self.audit_export_dir = base / "audit-export"
        return self

    def tier_url(self, tier: int) -> str | None:
        return {0: self.tier0_url, 1: self.tier1_url, 2: self.tier2_url}[tier]

    def embedded_root(self, tier: int) -> Path | None:
        """The folder of ``tier``'s embedded default root (``data_dir``/tier0/<node>,
        ``data_dir``/tier1: the demo's and the local stack's own folders) when the tier is left at
        it; None otherwise. Only such a folder is ever created by the product: a configured root
        must exist (a missing mount is unavailable, never made)."""
        base = Path(self.data_dir).expanduser().absolute()
        default = {0: base / "tier0" / self.node, 1: base / "tier1"}.get(tier)
        return default if default is not None and self.tier_url(tier) == str(default) else None

    def price_gb_month(self, tier: int) -> float:
        return {0: self.tier0_price_gb_month, 1: self.tier1_price_gb_month, 2: self.tier2_price_gb_month}[tier]

    def retention(self, tier: int) -> RetentionPolicy:
        return {0: self.retention_tier0, 1: self.retention_tier1, 2: self.retention_tier2}[tier]


class _TierPolicyDefaults(PydanticBaseSettingsSource):
    """The lowest source: each tier's default retention policy as fields, so that a policy given
    in part (``CKPT_RETENTION_TIER2__MAX_BYTES=50TB`` alone, a ``[retention_tier1]`` table with
    one key, a dict of some fields) changes those fields of the tier's default and keeps the rest
    (Tier 2's "retention off", Tier 1's ``keep_last``); a ``RetentionPolicy`` given whole replaces
    it whole."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # every value comes from __call__

    def __call__(self) -> dict[str, Any]:
        fields = self.settings_cls.model_fields
        return {name: fields[name].default.model_dump() for name in ("retention_tier0", "retention_tier1",
                                                                      "retention_tier2")}


def redact_url(url: str) -> str:
    """``url`` (or a message holding URLs) with the secret of each ``user:password@`` replaced by
    ``***`` (``***@`` for a bare token): the form in which a connection URL may appear in a
    message, a log line or anything Prefect stores. A password may hold "/", "@", "?" or "#"
    (``_from_host`` finds where the host starts)."""
    import re

    def one(m: re.Match[str]) -> str:
        scheme, rest = m.group(1), m.group(2)
        tail = _from_host(rest)
        if tail == rest:
            return m.group(0)
        userinfo = rest[: len(rest) - len(tail) - 1]
        return f"{scheme}://{userinfo.split(':', 1)[0] + ':' if ':' in userinfo else ''}***@{tail}"

    text = re.sub(r"([A-Za-z][\w+.-]*)://([^\s'\"]+)", one, url)
    return re.sub(r"([^\s/:@'\"]+):[^\s/@'\"*]+@", r"\1:***@", text)  # a user:password@host without a scheme


# query parameters whose values are shown as they are: everything else is dropped from the shown
# form, since a tier URL's query may carry a token, a signature or a key under any name
_HARMLESS_PARAMS = frozenset({"region", "version", "versionid", "version_id", "anon", "use_ssl", "timeout",
                              "block_size", "project", "location"})


# a host as it may follow a userinfo's "@": a bracketed IPv6 literal, a dotted IPv4 address or a name
# whose last label is not all digits (RFC 1123), then an optional port
_HOST_PORT = r"(?:\[[0-9A-Fa-f:.]+\]|\d{1,3}(?:\.\d{1,3}){3}|(?:[\w~%-]+\.)*[\w~%-]*[^\W\d][\w~%-]*\.?)(?::\d*)?"


def _from_host(rest: str) -> str:
    """``rest`` (what follows ``scheme://``) from its host on: without its userinfo.

    A password may hold "/", "?", "#" or "@", and then the authority does not end at the first
    "/": the userinfo runs to the last "@" followed by a host (``_HOST_PORT``, then "/" or the
    end), before the query if one there qualifies. When the part before the first "/" is a
    userinfo's for certain (it holds "@", or a ":" not followed by a port), such an "@" is looked
    for in the whole URL, and failing one the last "@" ends the userinfo. When it reads as
    HOST:PORT, it may be a user and the digits a password starts with ("user:123/x@host/p"): an
    "@" before the query followed by a host is taken for the userinfo's end (a path that holds
    "@name" is shown from "name" on: a URL shown short, never a secret shown); a path "@" followed
    by no host ("nas:22/ckpt/v@2") leaves the URL as it is. Without "@" or ":" before the first
    "/" there is no userinfo ("memory://root/v@2", ``file:///a@b/c``)."""
    import re

    head = re.split(r"[?#]", rest, maxsplit=1)[0]
    netloc = head.split("/", 1)[0]
    certain = "@" in netloc or (":" in netloc and not re.fullmatch(_HOST_PORT, netloc))
    if not certain and ":" not in netloc:
        return rest

    def host_after(ats: list[int]) -> int | None:
        for at in reversed(ats):
            if re.fullmatch(_HOST_PORT, re.split(r"[/?#]", rest[at + 1:], maxsplit=1)[0]):
                return at
        return None

    in_head = [i for i, c in enumerate(head) if c == "@"]
    at = host_after(in_head)
    if at is None and certain:
        beyond = [i for i, c in enumerate(rest) if c == "@" and i >= len(head)]
        at = host_after(beyond)
        if at is None and (in_head or beyond):
            at = (beyond or in_head)[-1]
    return rest if at is None else rest[at + 1:]


def display_url(url: str) -> str:
    """The form of a store's URL that may be recorded and shown (catalog replicas, events,
    artifacts, ``ckpt show``), built by allow-list: scheme, host, port and path; no userinfo
    (``user:password@``, a password holding "@", "/", "?" or "#" included: ``_from_host``), no
    fragment, and only the query parameters known harmless (``_HARMLESS_PARAMS``). The store
    keeps the real URL."""
    from urllib.parse import parse_qsl, urlencode

    scheme, sep, rest = url.partition("://")
    if not sep:
        return url  # a plain path
    rest = _from_host(rest).split("#", 1)[0]
    rest, _, query = rest.partition("?")
    kept = [(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k.lower() in _HARMLESS_PARAMS]
    return f"{scheme}://{rest}" + (f"?{urlencode(kept, safe='/:')}" if kept else "")


def tier2_url_problem(url: str) -> str | None:
    """Why ``url`` may not be the Tier 2 root (None when it may), as the storage backend
    registered for its scheme says (``core.storage.registry.tier2_url_problem``)."""
    from core.storage import tier2_url_problem as problem  # deferred: cycle — core.storage.fsspec imports this module

    return problem(url)


def load_settings(**overrides: Any) -> Settings:
    """Read settings once; turn validation errors into one clear ``ConfigError``."""
    from pydantic import ValidationError

    try:
        return Settings(**overrides)
    except ValidationError as exc:
        lines = [f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()]
        raise ConfigError("invalid settings: " + "; ".join(lines)) from None
