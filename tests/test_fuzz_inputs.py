"""Fuzzed plan, lengths and profile files and training settings: success or a one-line error with exit 2, never a
traceback, never a non-finite number or an inconsistent result (cases in fuzz_cases.py).

FUZZ_EXAMPLES cases per kind keep this file to seconds; `python benchmarks/fuzz_inputs.py` runs
the same cases 1,000 per kind and writes benchmarks/results/fuzz_inputs.json.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_cases import (PLANNERS_FOR_LENGTHS, lengths_case, lengths_files, mutated_plans, mutated_profiles,
                        plan_case, profile_case, settings_case, training_settings)

FUZZ_EXAMPLES = 60
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(doc=mutated_plans())
def test_mutated_plan_files_end_in_a_result_or_one_line(doc):
    with tempfile.TemporaryDirectory() as tmp:
        plan_case(doc, Path(tmp))


@FUZZ
@given(data=lengths_files(), planner=st.sampled_from(PLANNERS_FOR_LENGTHS))
def test_fuzzed_lengths_files_end_in_a_result_or_one_line(data, planner):
    with tempfile.TemporaryDirectory() as tmp:
        lengths_case(data, Path(tmp), planner)


@FUZZ
@given(doc=mutated_profiles())
def test_mutated_profiles_end_in_a_result_or_one_line(doc):
    with tempfile.TemporaryDirectory() as tmp:
        profile_case(doc, Path(tmp))


@FUZZ
@given(case=training_settings())
def test_fuzzed_training_settings_end_in_validated_settings_or_one_line(case):
    with tempfile.TemporaryDirectory() as tmp:
        settings_case(*case, Path(tmp))
