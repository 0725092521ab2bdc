"""benchmarks/burst.py's summary: the figures it derives, its verdict and its last line
(the burst itself needs servers and minutes: run by hand, see the script)."""

from __future__ import annotations

from benchmarks.burst import Phase, agents_that_fit, cpu_between, last_line, report


def _phase(**kw) -> Phase:
    base = dict(server="postgres+redis", parts=64, agents=64, verified=64, completions=1, archives=1,
                to_verified_s=40.0, to_durable_s=52.5, span_s=50.0, events=1000, flow_runs=65, task_runs=450,
                cpu_s=200.0, copy_cpu_per_part_s=0.125)
    return Phase(**{**base, **kw})


def test_rates_are_per_second_of_the_burst_and_cpu_is_per_part_less_the_copy():
    p = _phase()
    assert p.rate(p.flow_runs) == 1.3 and p.rate(p.task_runs) == 9.0 and p.rate(p.events) == 20.0
    assert p.cpu_outside_copy_per_part_s == 200 / 64 - 0.125


def test_last_line_has_the_exact_form():
    assert last_line(_phase(), _phase(server="sqlite", to_durable_s=75.04)) == (
        "burst: 64/64 parts verified, 1 completion, durable in 52.5 s (sqlite server: 75.0 s)")
    assert last_line(_phase(verified=63, completions=0, to_durable_s=None), None) == (
        "burst: 63/64 parts verified, 0 completions, durable in never (sqlite server: skipped)")


def test_a_missing_part_or_a_second_completion_fails_the_run():
    assert _phase().failures() == []
    assert "1 of 64 parts not verified" in _phase(verified=63).failures()[0]
    assert "completed 2 times" in _phase(completions=2).failures()[0]
    assert "archived 2 times" in _phase(archives=2).failures()[0]


def test_report_compares_the_two_servers():
    out = report([_phase(), _phase(server="sqlite", to_durable_s=105.0)])
    assert "postgres+redis / sqlite: x0.50" in out
    assert "64 / 1 / 1" in out


def test_agents_that_fit_in_the_memory_share():
    mb = 1e6
    assert agents_that_fit(64, 130 * mb, 20_000 * mb, 0.5) == 51      # 10 GB / (1.5 x 130 MB)
    assert agents_that_fit(64, 286 * mb, 22_000 * mb, 0.85) == 43     # the burst's tree at rest, 22 GB free
    assert agents_that_fit(64, 130 * mb, 40_000 * mb, 0.5) == 64
    assert agents_that_fit(64, 130 * mb, 100 * mb, 0.5) == 1


def test_cpu_of_a_process_reaped_during_the_burst_is_counted_once_through_its_reaper():
    # the fork server (10) forked part process 11 before the reading; 11 promotes (4 s after 0.5 s
    # before it) and exits, reaped: its 4.5 s land in 10's children's time; 12 is the next part's
    before = {10: 1.0, 11: 0.5}
    after = {10: 1.0 + 0.2 + 4.5, 12: 0.1}  # 11 is gone: /proc has nothing, proc_cpu would read 0
    assert cpu_between(before, after) == 0.2 + 4.0 + 0.1  # the server's own 0.2, the flow's 4.0, the new 0.1
    assert cpu_between({1: 2.0}, {1: 5.0}) == 3.0


def test_report_splits_the_cpu_and_the_agent_s_memory_by_role():
    p = _phase(cpu_by_role={"server": 64.0, "agents": 128.0, "database": 8.0},
               agent_pss_by_role={"agent": 71.0, "fork server": 47.0, "part process": 51.0, "resource tracker": 7.0})
    out = report([p])
    assert "1.00 / 2.00 / 0.12" in out and "71 / 47 / 51 / 7 MB" in out
    assert "PSS per node agent (--node-only), at rest" in out and "-" in out.splitlines()[-1]  # one agent: none
    p.node_agent_pss_by_role = {"agent": 62.0, "fork server": 46.0}
    out = report([p])
    assert "108 MB" in out and "62 / 46 / 0 / 0 MB" in out


def test_cpu_above_rest_takes_off_what_the_idle_stack_spends_over_the_same_span():
    # 200 CPU s over 64 parts in a 52.5 s window; at rest the stack spent 0.25 cores (server 0.125,
    # agents 0.0625 each way): 13.125 CPU s of the window were the stack idling, not the parts
    p = _phase(window_s=52.5, rest_s=60.0, rest_cores_by_role={"server": 0.125, "agents": 0.0625, "database": 0.0625})
    assert p.rest_cores == 0.25
    assert p.cpu_above_rest_per_part_s == (200 / 64 - 0.125) - 0.25 * 52.5 / 64
    out = report([p])
    assert "0.125 / 0.062 / 0.062" in out and f"{p.cpu_above_rest_per_part_s:.2f}" in out
    assert _phase().cpu_above_rest_per_part_s is None  # no --rest: not measured, shown as "-"
    assert "-" in next(line for line in report([_phase()]).splitlines() if "above the stack at rest" in line)
    assert _phase(rest_s=60.0, to_durable_s=None).cpu_above_rest_per_part_s is None  # never durable: no figure
