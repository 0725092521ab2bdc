"""The checkpoint sizing model from the field, and each run's measured figure.

A checkpoint of a model with P parameters under mixed-precision AdamW is about 14 × P bytes
(bf16 weights 2 + fp32 master weights 4 + two fp32 Adam moments 8). Saving it every
``T_interval`` seconds to storage of bandwidth B stalls training for ``T_save = V / B`` each
time, so the fraction of cluster compute lost is ``ΔMFU = T_save / (T_interval + T_save)``.

Units are decimal (GB = 1e9 bytes), as storage vendors quote bandwidth; ``GiB`` is accepted
and means 2**30. Parsing errors raise ``BadInput`` so the CLI prints one clear line.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from statistics import median

from core.errors import BadInput

BYTES_PER_PARAM = 14  # mixed-precision AdamW: 2 (bf16) + 4 (fp32 master) + 8 (Adam m, v)

_COUNT = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_BYTES = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SECONDS = {"": 1, "S": 1, "SEC": 1, "M": 60, "MIN": 60, "H": 3600, "D": 86400}
_NUM = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"


def _parse(text: str, units: Mapping[str, float], what: str, suffix: str = "") -> float:
    m = re.fullmatch(_NUM + r"([A-Za-z]*)" + suffix + r"\s*", str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in units:
        raise BadInput(f"cannot read {what} {text!r}; e.g. {_EXAMPLES[what]}")
    value = float(m.group(1)) * units[m.group(2).upper()]
    if value <= 0:
        raise BadInput(f"{what} must be positive, got {text!r}")
    return value


_EXAMPLES = {"parameter count": "'70B', '7.5B', '350M'", "interval": "'30m', '1h', '90s'", "MTBF": "'3h', '90m'",
             "bandwidth": "'2GB/s', '500MB/s', '1.5GiB/s'", "size": "'980GB', '1.5TiB'"}


def parse_params(text: str) -> float:
    """'70B' -> 7e10 parameters."""
    return _parse(text, _COUNT, "parameter count")


def parse_duration(text: str, what: str = "interval") -> float:
    """'30m' -> 1800 seconds; a bare number is seconds. ``what`` names it in the error."""
    return _parse(text, _SECONDS, what)


def parse_bandwidth(text: str) -> float:
    """'2GB/s' -> 2e9 bytes per second ('/s' optional)."""
    return _parse(text, _BYTES, "bandwidth", suffix=r"(?:\s*/\s*s)?")


def parse_size(text: str) -> float:
    return _parse(text, _BYTES, "size")


@dataclass(frozen=True)
class Plan:
    """The model's figures for one (size, interval, bandwidth)."""

    checkpoint_bytes: float
    interval_seconds: float
    bandwidth_bytes_per_s: float

    @property
    def save_seconds(self) -> float:
        return self.checkpoint_bytes / self.bandwidth_bytes_per_s

    @property
    def delta_mfu(self) -> float:
        return delta_mfu(self.save_seconds, self.interval_seconds)


def delta_mfu(save_seconds: float, interval_seconds: float) -> float:
    """Fraction of compute lost: T_save / (T_interval + T_save)."""
    return save_seconds / (interval_seconds + save_seconds)


def plan(params: float, interval_seconds: float, bandwidth: float) -> Plan:
    return Plan(BYTES_PER_PARAM * params, interval_seconds, bandwidth)


@dataclass(frozen=True)
class RunFigure:
    """A run's measured cost of checkpointing, from the writer stall times in the catalog."""

    run: str
    checkpoints: int
    median_stall_seconds: float
    median_interval_seconds: float | None
    delta_mfu: float | None  # None with fewer than two checkpoints (no interval to measure)


def measured(run: str, saves: list[tuple[datetime, float]]) -> RunFigure | None:
    """``saves``: (created_at, writer_stall_seconds) of a run's checkpoints; ones without a
    recorded stall are skipped. ΔMFU is the total stall over the wall time it was spent in
    (first save to the end of the last one), i.e. the model's formula summed over the run."""
    saves = sorted((t, s) for t, s in saves if s is not None)
    if not saves:
        return None
    stalls = [s for _, s in saves]
    gaps = [(b - a).total_seconds() for (a, _), (b, _) in itertools.pairwise(saves)]
    dmfu = None
    if gaps:
        wall = (saves[-1][0] - saves[0][0]).total_seconds() + stalls[-1]
        dmfu = sum(stalls) / wall if wall > 0 else None
    return RunFigure(run, len(saves), median(stalls), median(gaps) if gaps else None, dmfu)


def fmt_metrics(metrics: Mapping[str, float]) -> str:
    """``grad_norm=inf, loss=nan, lr=0.0003``: by name, a non-finite value as ``nan``/``inf``/``-inf``
    (a diverged run's checkpoint shows what it recorded)."""
    return ", ".join(f"{k}={v:g}" for k, v in sorted(metrics.items()))


def fmt_bytes(n: float) -> str:
    """Decimal units with three significant figures: 980 GB, 1.23 TB, 50.0 MB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{_sig3(n / size)} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float) -> str:
    return f"{_sig3(s)} s"


def fmt_percent(fraction: float) -> str:
    return f"{_sig3(fraction * 100)} %"


def _sig3(x: float) -> str:
    """Three significant figures, no exponent, no trailing zeros lost: 490, 19.6, 21.4, 1.08."""
    if x == 0:
        return "0"
    digits = max(0, 2 - int(f"{abs(x):e}".split("e")[1]))
    return f"{x:.{digits}f}"


# --- orchestration load: one checkpoint burst of N nodes against one Prefect server -------------
@dataclass(frozen=True)
class ServerCapacity:
    """What one Prefect server sustained during a measured checkpoint burst, and the work one
    checkpoint costs it: flow and task runs per part and per checkpoint (one promote run per
    checkpoint whatever its parts; a burst report may hold another mode's counts), and the CPU
    seconds its processes (API server and services, not its database) spend per part above
    their rest. ``source`` says where the figures come from."""

    flow_runs_per_s: float
    task_runs_per_s: float
    flow_runs_per_part: float
    task_runs_per_part: float
    source: str
    flow_runs_per_checkpoint: float = 0.0
    task_runs_per_checkpoint: float = 0.0
    cpu_per_part: float | None = None


@dataclass(frozen=True)
class RestLoad:
    """What idle agents cost the Prefect server's processes, in cores, before any checkpoint:
    the server's own loops (``base_cores``), and per agent its runner's poll for scheduled runs
    every ``poll_seconds`` (``PREFECT_RUNNER_POLL_FREQUENCY``: ``cpu_per_poll`` CPU seconds each)
    and the rest of what it holds open (``cores_per_agent``: its event subscriptions)."""

    cpu_per_poll: float
    cores_per_agent: float
    source: str
    base_cores: float = 0.0

    def cores(self, agents: int, poll_seconds: float) -> float:
        return self.base_cores + agents * (self.cores_per_agent + self.cpu_per_poll / poll_seconds)


# Measured by `benchmarks/burst.py --nodes 64 --part-mb 16 --no-sqlite --mem-fraction 0.7`
# (2026-12-04, 11:10 UTC, its first phase: the pipeline as shipped): Prefect 3.9 API server
# (--no-services) + services process on PostgreSQL + Redis (ckpt.production_stack), 64 parts
# served by 64 agents, one per node, with the warm promote processes they fork, on this project's
# 2-core, 24 GiB machine. Sustained over the burst: 64 flow runs (one promote per part; the
# milestone archived inline, so no archive run) and 130 task runs (per part tier0-to-tier1 and
# tier1-to-tier2, plus the checkpoint's mark-complete and plan-retention) in 59 s, i.e. 1.08
# flow runs/s and 2.2 task runs/s (1,257 events, 21/s); durable 60.0 s after the burst. The
# agents (0.57 CPU s per part) shared the two cores with the server (0.62), so these rates are
# what the whole machine sustained: a floor for a server with cores of its own. A report from
# the target cluster (`ckpt plan --burst-report`) replaces them. (Earlier: 0.37 flow runs/s and
# 0.74 task runs/s on 2026-12-01 with 20 agents, before the agents started the runner's runs warm
# and a promote run left out Prefect's round trips it never uses; 0.14 and 0.9 before each hop of
# a part became one task run.) The runs per checkpoint of the one promotion path and the CPU per
# part above rest: MEASURED_RUNS and MEASURED_CPU_PER_PART below.
MEASURED_SERVER = ServerCapacity(flow_runs_per_s=1.08, task_runs_per_s=2.2, flow_runs_per_part=1.0,
                                 task_runs_per_part=2.0, task_runs_per_checkpoint=2.0,
                                 source="benchmarks/burst.py --nodes 64 on 2 shared cores: a floor")

# Runs per part and per checkpoint of the one promotion path (each node's agent promotes its parts
# with no run; one promote run per checkpoint, its hops inline), counted in the 64-node bursts of a
# milestone (the archive is part of it): 1 flow run and 2 task runs (mark-complete and
# plan-retention) a checkpoint (docs/design/burst.md; a run per part, the mode it replaced, cost
# 64 flow runs and 130 task runs).
MEASURED_RUNS = (0.0, 1.0, 0.0, 2.0)  # flow runs per part, per checkpoint, task runs per part, per checkpoint

# The server's processes (API and services) at rest and per part, measured by
# `benchmarks/burst.py --part-mb 16 --no-sqlite --rest 30 --warm-bursts 1` (2026-12-05, 2 shared
# cores): 32 agents polling every 5 s (server at rest 0.160 / 0.144 cores, two phases) and every
# 30 s (0.069 / 0.052), 16 agents every 5 s and 30 s (0.072, 0.051); least squares over the six:
# 17 millicores of its own, 0.90 an agent (its subscriptions), 16.1 ms of CPU a poll (the fit is
# within 0.011 cores of each; it puts 64 agents at 5 s at 0.281 cores, where an earlier run of
# older code measured 0.224: on the high side). Above that rest, per part of the burst: one run
# per checkpoint 0.133 / 0.138 (32 parts), 0.096 / 0.114 (16); one run per part 0.539 / 0.377 (32
# parts): the higher of each.
MEASURED_CPU_PER_PART = 0.14
MEASURED_REST = RestLoad(cpu_per_poll=0.0161, cores_per_agent=0.0009, base_cores=0.017,
                         source="benchmarks/burst.py --rest 30, 16 and 32 agents, 5 and 30 s polls")


def measured_capacity() -> ServerCapacity:
    """The built-in capacity (``MEASURED_SERVER``'s rates) with the runs and the CPU per part of
    the promotion path."""
    f_part, f_ckpt, t_part, t_ckpt = MEASURED_RUNS
    return replace(MEASURED_SERVER, flow_runs_per_part=f_part, flow_runs_per_checkpoint=f_ckpt,
                   task_runs_per_part=t_part, task_runs_per_checkpoint=t_ckpt, cpu_per_part=MEASURED_CPU_PER_PART,
                   source=f"{MEASURED_SERVER.source}; one promote run per checkpoint")


SATURATION_LIMIT = 10_000_000  # nodes: past this the model says "not within"


@dataclass(frozen=True)
class OrchestrationLoad:
    """The Prefect work of one checkpoint of ``nodes`` parts every ``interval_seconds``, against
    one server: its run rates, and, where known, its processes' CPU (``server_cores`` of them)
    less what ``nodes`` idle agents polling every ``poll_seconds`` already take (``rest``)."""

    nodes: int
    interval_seconds: float
    capacity: ServerCapacity
    rest: RestLoad | None = None
    poll_seconds: float = 5.0
    server_cores: float = 1.0

    @property
    def flow_runs_per_burst(self) -> float:
        c = self.capacity
        return self.nodes * c.flow_runs_per_part + c.flow_runs_per_checkpoint

    @property
    def task_runs_per_burst(self) -> float:
        c = self.capacity
        return self.nodes * c.task_runs_per_part + c.task_runs_per_checkpoint

    @property
    def rest_cores(self) -> float:
        """The server's cores taken by the idle agents (0 when not modelled)."""
        return self.rest.cores(self.nodes, self.poll_seconds) if self.rest is not None else 0.0

    @property
    def cpu_seconds(self) -> float | None:
        """The drain time the server's CPU allows: the burst's CPU over the cores the idle agents
        leave (infinite when they take them all); None when the CPU per part is not known."""
        if self.rest_cores >= self.server_cores:
            return math.inf
        if self.capacity.cpu_per_part is None:
            return None
        return self.nodes * self.capacity.cpu_per_part / (self.server_cores - self.rest_cores)

    @property
    def drain_seconds(self) -> float:
        """How long the server needs for one burst: the slowest of its flow runs, its task runs
        (at the measured rates) and its CPU."""
        c = self.capacity
        return max(self.flow_runs_per_burst / c.flow_runs_per_s, self.task_runs_per_burst / c.task_runs_per_s,
                   self.cpu_seconds or 0.0)

    @property
    def utilisation(self) -> float:
        """Share of the interval the server spends on the burst; 1 = saturated (the next burst
        arrives before this one is through)."""
        return self.drain_seconds / self.interval_seconds

    @property
    def saturation_nodes(self) -> int | None:
        """The smallest N whose burst takes the server the whole interval (the drain time grows
        with N: found by bisection); None when no N up to ``SATURATION_LIMIT`` does."""
        def full(n: int) -> bool:
            return replace(self, nodes=n).utilisation >= 1

        if not full(SATURATION_LIMIT):
            return None
        if full(1):
            return 1
        lo, hi = 1, SATURATION_LIMIT  # not full(lo), full(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if full(mid) else (mid, hi)
        return hi


def _phase(report: list[dict], server: str) -> dict:
    """The ``server`` phase of a ``benchmarks/burst.py --json`` report."""
    for phase in report:
        if phase.get("server") == server:
            return phase
    raise BadInput(f"the burst report has no {server!r} phase")


def _server_rest(phase: dict) -> float | None:
    """The server's cores at rest a phase measured (``--rest``), else None."""
    rest = (phase.get("rest_cores_by_role") or {}).get("server")
    return rest if phase.get("rest_s") and rest is not None else None


def capacity_from_report(report: list[dict], server: str = "postgres+redis") -> ServerCapacity:
    """The capacity a ``benchmarks/burst.py --json`` report measured for ``server``: its run
    rates, its runs (a phase with fewer flow runs than parts ran one per checkpoint: they count
    per checkpoint, its task runs per part), and, when it watched the stack at rest first
    (``--rest``), the server's CPU per part above its rest."""
    phase = _phase(report, server)
    parts = phase["parts"] or 1
    if not phase.get("flow_runs_per_s") or not phase.get("task_runs_per_s"):
        raise BadInput(f"the burst report's {server} phase measured no rates")
    per_checkpoint = phase["flow_runs"] < parts
    cpu = None
    rest = _server_rest(phase)
    if rest is not None and "server" in (phase.get("cpu_by_role") or {}):
        cpu = max(0.0, phase["cpu_by_role"]["server"] - rest * phase.get("window_s", 0.0)) / parts
    return ServerCapacity(phase["flow_runs_per_s"], phase["task_runs_per_s"],
                          0.0 if per_checkpoint else phase["flow_runs"] / parts, phase["task_runs"] / parts,
                          source=f"burst report ({phase['parts']} parts, {phase['agents']} agents)",
                          flow_runs_per_checkpoint=phase["flow_runs"] if per_checkpoint else 0.0,
                          cpu_per_part=cpu)


def rest_from_report(report: list[dict], server: str = "postgres+redis") -> RestLoad | None:
    """The server's cores at rest per agent a ``burst.py --rest`` report measured for ``server``
    (at the poll frequency its agents ran with: not scaled by ``--poll-seconds``); None when it
    did not watch the stack at rest."""
    phase = _phase(report, server)
    rest = _server_rest(phase)
    if rest is None or not phase.get("agents"):
        return None
    return RestLoad(cpu_per_poll=0.0, cores_per_agent=rest / phase["agents"],
                    source=f"burst report ({phase['agents']} agents at rest, at their poll frequency)")


# --- recovery: how long the cluster waits for its checkpoint back, and what a failure costs -----
# Read bandwidths the model assumes where the user gives none; each is overridable on the CLI.
NVME_READ = 7e9  # one PCIe Gen4 NVMe drive, sequential read (Tier 0 read in place)
S3_STREAM = 90e6  # one S3 GET connection (AWS performance guidelines: ~85-90 MB/s)
S3_STREAMS = 16  # parallel ranged GETs per node (AWS: 8-16 MiB ranges, many connections)
NODE_LINK = 12.5e9  # a node's network link, 100 Gb/s


@dataclass(frozen=True)
class RecoveryModel:
    """The read side of the tiers. ``tier1_bytes_per_s`` is the shared file system's aggregate
    read bandwidth (all nodes together); None means the plan's own (write) bandwidth."""

    tier0_bytes_per_s: float = NVME_READ
    tier1_bytes_per_s: float | None = None
    s3_stream_bytes_per_s: float = S3_STREAM
    s3_streams: int = S3_STREAMS
    node_link_bytes_per_s: float = NODE_LINK


@dataclass(frozen=True)
class TierRTO:
    """Time to get a checkpoint of ``nodes`` parts back from one tier. ``node_seconds``: one
    node fetches its own part alone; ``cluster_seconds``: every node fetches its part at once
    (first start to last part loaded); ``whole_seconds``: every node fetches the whole
    checkpoint, as a restore of the checkpoint on each node does."""

    tier: int
    node_seconds: float
    cluster_seconds: float
    whole_seconds: float


def recovery_times(checkpoint_bytes: float, nodes: int, bandwidth: float,
                   model: RecoveryModel = RecoveryModel()) -> list[TierRTO]:
    """RTO per tier. Tier 0 is each node's own drive (nothing shared); Tier 1 is shared: N
    nodes split its aggregate bandwidth, each capped by its link; Tier 2 (S3) scales out, so
    each node reads at its streams × per-stream rate, capped by its link."""
    part = checkpoint_bytes / nodes
    link = model.node_link_bytes_per_s
    t0 = model.tier0_bytes_per_s
    t1 = model.tier1_bytes_per_s or bandwidth
    t2 = min(model.s3_streams * model.s3_stream_bytes_per_s, link)
    return [
        TierRTO(0, part / t0, part / t0, checkpoint_bytes / t0),
        TierRTO(1, part / min(t1, link), max(part / link, checkpoint_bytes / t1),
                max(checkpoint_bytes / link, nodes * checkpoint_bytes / t1)),
        TierRTO(2, part / t2, part / t2, checkpoint_bytes / t2),
    ]


@dataclass(frozen=True)
class FailureCost:
    """With a failure every ``mtbf_seconds`` (of the whole job): the work lost per failure is
    half an interval (the expected distance back to the last checkpoint) plus the RTO, and the
    total overhead is the save overhead (ΔMFU) plus that loss per MTBF."""

    save_seconds: float
    interval_seconds: float
    mtbf_seconds: float
    rto_seconds: float

    @property
    def lost_per_failure_seconds(self) -> float:
        return self.interval_seconds / 2 + self.rto_seconds

    @property
    def overhead(self) -> float:
        return overhead(self.save_seconds, self.interval_seconds, self.mtbf_seconds, self.rto_seconds)


def overhead(save_seconds: float, interval_seconds: float, mtbf_seconds: float, rto_seconds: float) -> float:
    """Fraction of compute lost to saving and to failures: ΔMFU + (T_interval/2 + RTO) / MTBF."""
    return delta_mfu(save_seconds, interval_seconds) + (interval_seconds / 2 + rto_seconds) / mtbf_seconds


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young/Daly's optimal checkpoint interval, √(2·T_save·MTBF)."""
    return math.sqrt(2 * save_seconds * mtbf_seconds)


def best_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """The interval that minimises ``overhead`` exactly: d/dI [T/(I+T) + I/(2M)] = 0 gives
    I + T = √(2TM), i.e. Young/Daly's interval less the save (ΔMFU counts the save apart from
    the interval); never below zero."""
    return max(0.0, young_daly_interval(save_seconds, mtbf_seconds) - save_seconds)
