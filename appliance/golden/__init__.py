"""Golden answers: what each model answered to a few fixed probes when it was known good (`openarc golden record`),
and the judgement of a later answer against that record (`openarc golden check`, and the canary the front runs
before it says READY: appliance.front.canary).

This room is data and pure functions only: the probes (appliance.golden.probes), the record file
(appliance.golden.record) and the comparison (appliance.golden.compare). Running a probe is the front's business,
through a model's normal request path; nothing here imports the front, the worker or OpenVINO.
"""
