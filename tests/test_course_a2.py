"""Assignment a2_fa1_forward: released with no solution code, the solution gets full marks, the untouched release
zero, and its bugs (assignments/a2_fa1_forward/bugs.py) lose exactly their points with their messages.  The default
run grades the first three bugs; `pytest -m slow` grades every one."""

import pytest
from course_grading import (
    check_each_bug_loses_exactly_its_points,
    check_release_holds_no_solution_code,
    check_scores_csv_and_feedback,
    check_solution_gets_full_marks,
    check_untouched_release_gets_zero_and_the_batch_goes_on,
    graded_assignment,
)

NAME = "a2_fa1_forward"


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    return graded_assignment(NAME, tmp_path_factory)


def test_release_holds_no_solution_code(graded):
    check_release_holds_no_solution_code(graded)


def test_solution_gets_full_marks(graded):
    check_solution_gets_full_marks(graded)


def test_untouched_release_gets_zero(graded):
    check_untouched_release_gets_zero_and_the_batch_goes_on(graded)


def test_bugs_lose_exactly_their_points(graded):
    check_each_bug_loses_exactly_its_points(graded)


def test_scores_csv_and_feedback(graded):
    check_scores_csv_and_feedback(graded)


@pytest.mark.slow
def test_every_bug_loses_exactly_its_points(tmp_path_factory):
    check_each_bug_loses_exactly_its_points(graded_assignment(NAME, tmp_path_factory, all_bugs=True))
