"""The speedup projection against a case worked out by hand."""

import math

import pytest

from mpitrain.bench.projection import (NetworkModel, assumptions, fit_frames_exponent,
                                       frames_exponent_range, project_method,
                                       project_speedups, ring_allreduce_seconds, step_seconds,
                                       throughput_speedup)
from mpitrain.bench.report import projection_lines, summary_markdown

# The hand-computed case: 1,000,000 float32 parameters (4,000,000 bytes), links of
# 1 GB/s with 10 us latency, 10 ms of compute per step, one average every 8 steps.
NBYTES = 4_000_000
NET = NetworkModel(latency_s=10e-6, bandwidth_bytes_per_s=1e9)
COMPUTE = 0.010
SYNC = 8


def test_ring_allreduce_cost_by_hand():
    # N = 4: bandwidth term 2 * 3/4 * 4e6 B / 1e9 B/s = 1.5 * 0.004 s = 0.006 s
    #        latency term   2 * 3 * 10e-6 s             = 0.00006 s
    #        total                                        0.00606 s
    assert NET.allreduce_seconds(NBYTES, 4) == pytest.approx(0.00606, rel=1e-12)
    # N = 2: 2 * 1/2 * 0.004 + 2 * 1 * 1e-5 = 0.004 + 0.00002 = 0.00402 s
    assert ring_allreduce_seconds(NBYTES, 2, latency_s=10e-6,
                                  bandwidth_bytes_per_s=1e9) == pytest.approx(0.00402)
    # one rank sends nothing
    assert NET.allreduce_seconds(NBYTES, 1) == 0.0


def test_throughput_speedup_by_hand():
    # step at N = 4: 0.010 + 0.00606 / 8 = 0.010 + 0.0007575 = 0.0107575 s
    assert step_seconds(4, compute_seconds=COMPUTE, nbytes=NBYTES, sync_every=SYNC,
                        network=NET) == pytest.approx(0.0107575)
    # speedup: 4 * 0.010 / 0.0107575 = 0.04 / 0.0107575 = 3.718336...
    s = throughput_speedup(4, compute_seconds=COMPUTE, nbytes=NBYTES, sync_every=SYNC,
                           network=NET)
    assert s == pytest.approx(3.718336, rel=1e-6)
    # gradient allreduce (every step): 0.04 / (0.010 + 0.00606) = 0.04 / 0.01606 = 2.490660
    assert throughput_speedup(4, compute_seconds=COMPUTE, nbytes=NBYTES, sync_every=1,
                              network=NET) == pytest.approx(2.490660, rel=1e-6)


def test_pairwise_exchange_costs_one_message_whatever_the_ranks():
    from mpitrain.bench.projection import exchange_seconds
    # one message of 4e6 B at 1e9 B/s plus the latency: 0.004 + 0.00001 s, at any N > 1
    for ranks in (2, 16, 128):
        assert exchange_seconds(ranks, NBYTES, NET, "pairwise") == pytest.approx(0.00401)
    assert exchange_seconds(1, NBYTES, NET, "pairwise") == 0.0
    # ADPSGD at 128 ranks: 128 * 0.010 / (0.010 + 0.00401) = 91.36...; a ring allreduce
    # every step would cost 2 * 127/128 * 0.004 + 2 * 127 * 1e-5 = 0.0104775 s:
    # 128 * 0.010 / 0.0204775 = 62.508...
    assert throughput_speedup(128, compute_seconds=COMPUTE, nbytes=NBYTES, sync_every=1,
                              network=NET, exchange="pairwise") == pytest.approx(91.363, rel=1e-4)
    assert throughput_speedup(128, compute_seconds=COMPUTE, nbytes=NBYTES, sync_every=1,
                              network=NET) == pytest.approx(62.508, rel=1e-4)
    with pytest.raises(ValueError, match="exchange"):
        exchange_seconds(2, NBYTES, NET, "broadcast")


def test_frames_exponent_by_hand():
    # frames 1000, 1200, 1440 at N = 1, 2, 4: ratios 1.2 = 2^b and 1.44 = 4^b with the
    # same b, so the least-squares fit is exact: b = ln 1.2 / ln 2 = 0.263034...
    b = fit_frames_exponent({1: 1000.0, 2: 1200.0, 4: 1440.0})
    assert b == pytest.approx(math.log(1.2) / math.log(2))
    assert b == pytest.approx(0.263034, rel=1e-5)
    # fewer frames at more ranks would mean b < 0: clipped to 0
    assert fit_frames_exponent({1: 1000.0, 2: 800.0}) == 0.0
    # without size 1 there is nothing to compare with
    assert fit_frames_exponent({2: 1000.0, 4: 1200.0}) is None
    assert fit_frames_exponent({1: 1000.0}) is None


def test_projected_rows_by_hand():
    b = math.log(1.2) / math.log(2)
    rows = project_speedups([1, 4, 16], compute_seconds=COMPUTE, nbytes=NBYTES,
                            sync_every=SYNC, network=NET, frames_exponent=b)
    assert [r["ranks"] for r in rows] == [1, 4, 16]
    one, four, sixteen = rows
    assert one["throughput_speedup"] == 1.0 and one["time_to_target_speedup"] == 1.0
    # N = 4: frames ratio 4^b = 1.44; time-to-target speedup 3.718336 / 1.44 = 2.582178
    assert four["frames_ratio"] == pytest.approx(1.44)
    assert four["time_to_target_speedup"] == pytest.approx(2.582178, rel=1e-6)
    # N = 16: allreduce 2 * 15/16 * 0.004 + 2 * 15 * 1e-5 = 0.0075 + 0.0003 = 0.0078 s;
    # step 0.010 + 0.0078 / 8 = 0.010975 s; throughput 0.16 / 0.010975 = 14.578588;
    # frames ratio 16^b = 1.2^4 = 2.0736; time to target 14.578588 / 2.0736 = 7.030569
    assert sixteen["allreduce_seconds"] == pytest.approx(0.0078)
    assert sixteen["throughput_speedup"] == pytest.approx(14.578588, rel=1e-6)
    assert sixteen["time_to_target_speedup"] == pytest.approx(7.030569, rel=1e-6)
    # no fitted exponent: throughput only
    rows = project_speedups([16], compute_seconds=COMPUTE, nbytes=NBYTES, sync_every=SYNC,
                            network=NET, frames_exponent=None)
    assert rows[0]["time_to_target_speedup"] is None


def test_method_projection_from_measured_figures():
    # 1,000,000 parameters are the 4,000,000 bytes of the hand-computed case
    frames = {1: 100.0, 2: 120.0}          # b = log 1.2 / log 2, as above
    proj = project_method([1, 4, 16], measured_compute_seconds=COMPUTE,
                          num_params=1_000_000, sync_every=SYNC, frames_to_target=frames,
                          network=NET)
    assert proj["compute_seconds_per_step"] == COMPUTE
    assert proj["compute_seconds_source"] == "measured on one rank"
    assert proj["bytes_per_allreduce"] == NBYTES and proj["sync_every_steps"] == SYNC
    assert proj["frames_exponent"] == pytest.approx(math.log(1.2) / math.log(2))
    assert proj["rows"][2]["throughput_speedup"] == pytest.approx(14.578588, rel=1e-6)
    assert proj["rows"][2]["time_to_target_speedup"] == pytest.approx(7.030569, rel=1e-6)
    # a stated compute time replaces the measured one; no crossing: throughput only
    proj = project_method([16], measured_compute_seconds=1.0, num_params=1_000_000,
                          sync_every=SYNC, frames_to_target={}, network=NET,
                          compute_seconds=COMPUTE)
    assert proj["compute_seconds_source"] == "option" and proj["frames_exponent"] is None
    assert proj["rows"][0]["throughput_speedup"] == pytest.approx(14.578588, rel=1e-6)
    assert proj["rows"][0]["time_to_target_speedup"] is None


def test_projection_range_from_refits_leaving_one_size_out():
    # frames 100, 120, 200 at N = 1, 2, 4.  Leaving out N = 4: b = ln 1.2 / ln 2 = 0.263;
    # leaving out N = 2: b = ln 2 / ln 4 = 0.5; the full fit (0.4526) lies between
    frames = {1: 100.0, 2: 120.0, 4: 200.0}
    low, high = frames_exponent_range(frames)
    assert low == pytest.approx(math.log(1.2) / math.log(2)) and high == pytest.approx(0.5)
    assert low <= fit_frames_exponent(frames) <= high
    # one size above 1: nothing to leave out
    assert frames_exponent_range({1: 100.0, 2: 120.0}) is None
    proj = project_method([16], measured_compute_seconds=COMPUTE, num_params=1_000_000,
                          sync_every=SYNC, frames_to_target=frames, network=NET)
    row = proj["rows"][0]
    thr = row["throughput_speedup"]
    assert row["time_to_target_range"] == pytest.approx((thr / 16 ** 0.5, thr / 16 ** low))
    lo, hi = row["time_to_target_range"]
    assert lo <= row["time_to_target_speedup"] <= hi
    assert proj["fitted_sizes"] == [1, 2, 4]


def test_projection_is_labelled_with_its_range_in_markdown_and_console():
    proj = project_method([1, 2, 4, 16], measured_compute_seconds=COMPUTE,
                          num_params=1_000_000, sync_every=SYNC,
                          frames_to_target={1: 100.0, 2: 120.0, 4: 200.0}, network=NET)
    report = {"environment": {}, "methods": ["m"], "speedups": [], "throughput": [],
              "accuracy": [], "projections": {"m": proj}, "paper_points": [],
              "assumptions": assumptions(NET), "notes": []}
    text = summary_markdown(report)
    assert "## Projection (a model's output, not measured)" in text
    lo, hi = proj["rows"][-1]["time_to_target_range"]
    assert f"({lo:.1f}-{hi:.1f})" in text and "(0.26-0.50)" in text
    (line,) = projection_lines(report)
    assert line.startswith("projected (not measured), m at N=16:")
    assert f"({lo:.1f}-{hi:.1f})" in line and "sizes 1,2,4" in line


def test_network_model_rejects_bad_values():
    with pytest.raises(ValueError, match="bandwidth"):
        NetworkModel(bandwidth_bytes_per_s=0)
    with pytest.raises(ValueError, match="latency"):
        NetworkModel(latency_s=-1e-6)
    with pytest.raises(ValueError, match="sync_every"):
        step_seconds(2, compute_seconds=COMPUTE, nbytes=NBYTES, sync_every=0, network=NET)


def test_hierarchical_exchange_by_hand():
    from mpitrain.bench.projection import exchange_seconds
    # nodes of 4 ranks: ring allreduce of the gradients over 4 ranks (0.00606 s, as
    # above), the broadcast on the node, the cheaper of a binomial tree 2 * 0.00401 and
    # scatter + allgather (2 + 3) * 1e-5 + 2 * 3/4 * 0.004 = 0.00605 s, and between
    # nodes one swap of 0.00401 s: 0.00606 + 0.00401 + 0.00605 = 0.01612 s
    for ranks in (8, 16, 128):
        assert exchange_seconds(ranks, NBYTES, NET, "hierarchical",
                                ranks_per_node=4) == pytest.approx(0.01612)
    # one node: no swap, 0.00606 + 0.00605
    assert exchange_seconds(4, NBYTES, NET, "hierarchical",
                            ranks_per_node=4) == pytest.approx(0.01211)
    # 2 ranks of a 4-rank node: 0.00402 + min(0.00401, 0.00402)
    assert exchange_seconds(2, NBYTES, NET, "hierarchical",
                            ranks_per_node=4) == pytest.approx(0.00803)
    with pytest.raises(ValueError, match="ranks_per_node"):
        exchange_seconds(8, NBYTES, NET, "hierarchical")


def test_the_report_prices_adpsgd_as_its_settings_make_it_communicate():
    from mpitrain.bench.options import BenchOptions
    from mpitrain.bench.report import build_report
    throughput = [{"method": "adpsgd", "ranks": 1, "frames_per_sec": 1e5,
                   "compute_seconds_per_step": COMPUTE, "num_params": NBYTES // 4,
                   "sync_period": 1}]

    def projection(parallel):
        report = build_report(throughput, [], sizes=(1,), methods=("adpsgd",),
                              options=BenchOptions(project_to=(16,), network=NET),
                              environment={}, config={"parallel": parallel})
        return report["projections"]["adpsgd"]

    flat = projection({"hierarchical": False, "ranks_per_node": 0})
    assert flat["exchange"] == "pairwise"
    assert flat["rows"][-1]["allreduce_seconds"] == pytest.approx(0.00401)
    nodes = projection({"hierarchical": True, "ranks_per_node": 4})
    assert (nodes["exchange"], nodes["ranks_per_node"]) == ("hierarchical", 4)
    assert nodes["rows"][-1]["ranks"] == 16
    assert nodes["rows"][-1]["allreduce_seconds"] == pytest.approx(0.01612)
    assert nodes["rows"][-1]["throughput_speedup"] == pytest.approx(16 * COMPUTE
                                                                    / (COMPUTE + 0.01612))


def test_a_kaldi_job_ramp_trains_on_the_mean_of_its_jobs():
    from mpitrain.bench.options import BenchOptions
    from mpitrain.bench.projection import active_ranks_of
    from mpitrain.bench.report import build_report
    ramp = {"num_jobs_initial": 4, "num_jobs_final": 0, "jobs_step": 1}
    active = active_ranks_of("kaldi", ramp)
    # 4 -> 16 jobs, linear: the mean is about (4 + 16) / 2
    assert active(16) == pytest.approx(10.0, abs=0.01)
    assert active(2) == 2.0 and active(1) == 1.0          # capped at the ranks
    assert active_ranks_of("kaldi", {"num_jobs_final": 8})(16) == 8.0
    assert active_ranks_of("kaldi", {}) is None           # every rank trains
    assert active_ranks_of("bmuf", ramp) is None
    throughput = [{"method": "kaldi", "ranks": 1, "frames_per_sec": 1e5,
                   "compute_seconds_per_step": COMPUTE, "num_params": NBYTES // 4,
                   "sync_period": SYNC}]
    report = build_report(throughput, [], sizes=(1,), methods=("kaldi",),
                          options=BenchOptions(project_to=(16,), network=NET),
                          environment={}, config={"parallel": ramp})
    row = report["projections"]["kaldi"]["rows"][-1]
    all_train = throughput_speedup(16, compute_seconds=COMPUTE, nbytes=NBYTES,
                                   sync_every=SYNC, network=NET)
    assert row["ranks"] == 16
    assert row["throughput_speedup"] == pytest.approx(all_train * active(16) / 16)
