"""Shared pytest setup: the hypothesis profiles.

``ci`` (the default) keeps the whole suite fast on two cores; ``thorough`` is for a nightly or
pre-release run and is selected with ``DTYPEPLAN_HYPOTHESIS_PROFILE=thorough``. Tests take
their example counts from the loaded profile (``settings.default.max_examples``), scaled down
for the ones that build optimizers, so one switch sizes every property test.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_ENV = "DTYPEPLAN_HYPOTHESIS_PROFILE"

# Deadlines are off: the first torch call of a process (kernel dispatch warm-up) can take far
# longer than later ones, which would make a deadline flaky without saying anything useful.
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    max_examples=3000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get(PROFILE_ENV, "ci"))
