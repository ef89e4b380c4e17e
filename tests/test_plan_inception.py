"""Acceptance of the planner issue on the real Inception-style graphs: with 2 streams the
predicted step time is at most 0.7x the predicted serial time.

The forward and backward graphs are captured and profiled for real, but the times are
replaced by the cost model's roofline estimates (FLOPs and bytes at fixed machine
constants) so that the check does not depend on how busy the test machine is.
"""

from __future__ import annotations

import dataclasses

import autopar
from autopar.planning.costmodel import MachineModel
from autopar.planning.partition import make_plan
from autopar.profiling.store import ProfileStore
from autopar.tools import zoo


def test_inception_two_streams_predicted_at_most_0_7_of_serial():
    model, inputs = zoo.build("inception")
    cm = autopar.compile(model, store=ProfileStore.memory(), adapt=False)
    cm(*inputs).sum().backward()
    machine = dataclasses.replace(MachineModel.default_cpu(), sync_cost_s=10e-6, gil_s=3e-6)
    predicted = serial = 0.0
    for record in cm._autopar_pipeline.records:
        table = record.table.copy()
        table["time_s"] = 0.0  # no measurement: the cost model falls back to the roofline
        table["time_1t_s"] = 0.0
        plan = make_plan(table, streams=2, graph_id=record.tag, machine=machine)
        assert len(plan.streams) == 2, plan.summary()
        predicted += plan.predicted_step_time
        serial += plan.serial_time
    assert predicted <= 0.7 * serial, (predicted, serial)
