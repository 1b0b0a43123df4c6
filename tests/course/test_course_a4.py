"""Assignment a4_fa2_backward: released with no solution code, the solution gets full marks, the untouched release
zero, and its bugs (assignments/a4_fa2_backward/bugs.py) lose exactly their points with their messages.  The default
run grades the first bug; `pytest -m slow` grades every one (tests/course/course_grading.py)."""

from course_grading import install_tests

install_tests(globals(), "a4_fa2_backward")
