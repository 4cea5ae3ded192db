"""Clock plan: faster or equal step time within the power envelope, idle stages slow down."""

import pytest

from megatron_elaswave.planner.frequency import PowerModel, ReplicaLoad, StageLoad, pipeline_ns, plan_clocks


def replica(times, n, devices=1):
    return ReplicaLoad(
        tuple(StageLoad(compute_ns=t, fixed_ns=0, devices=devices) for t in times), n, send_ns=0
    )


def test_nominal_only_levels_give_nominal_clocks():
    power = PowerModel(clock_levels=(1.0,))
    plan = plan_clocks([replica([100, 100], 4)], sync_ns=0, idle_devices=0, power=power)
    assert plan.clocks == ((1.0, 1.0),) and plan.step_ns == plan.nominal_step_ns == 500


def test_slack_is_traded_for_a_faster_critical_path():
    # Stage 0 is the bottleneck; stage 1 idles half the time.
    loads = [replica([200, 100], 10)]
    plan = plan_clocks(loads, sync_ns=0, idle_devices=0, power=PowerModel())
    first, second = plan.clocks[0]
    assert first > 1.0 > second
    assert plan.step_ns < plan.nominal_step_ns
    assert plan.average_power_w <= plan.nominal_average_power_w * (1 + 1e-9)
    assert plan.step_ns == pipeline_ns(loads[0], plan.clocks[0])


def test_balanced_pipeline_cannot_boost_within_the_envelope():
    plan = plan_clocks([replica([100, 100, 100], 8)], sync_ns=0, idle_devices=0, power=PowerModel())
    assert plan.step_ns == plan.nominal_step_ns
    assert plan.clocks == ((1.0, 1.0, 1.0),)


def test_a_replica_with_fewer_microbatches_slows_down_and_saves_energy():
    fast, light = replica([100, 100], 10), replica([100, 100], 6)
    plan = plan_clocks(
        [fast, light], sync_ns=0, idle_devices=0, power=PowerModel(clock_levels=(0.5, 0.75, 1.0))
    )
    assert plan.clocks[0] == (1.0, 1.0)
    assert max(plan.clocks[1]) < 1.0
    assert plan.step_ns == plan.nominal_step_ns
    assert plan.energy_j < plan.nominal_energy_j


def test_fixed_time_does_not_scale_with_the_clock():
    stage = StageLoad(compute_ns=100, fixed_ns=50, devices=1)
    assert stage.time_ns(0.5) == 250 and stage.time_ns(2.0) == 100


def test_invalid_power_models_are_rejected():
    with pytest.raises(ValueError):
        PowerModel(clock_levels=(0.8, 0.9))
    with pytest.raises(ValueError):
        PowerModel(clock_levels=(1.0, 0.9))
