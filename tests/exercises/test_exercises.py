"""Every exercise's worked solution passes its check, and the typical wrong answers each exercise ships fail it;
an answer left as ``...`` is "not attempted", not a failure."""

import importlib.util

import pytest

import flashnb
from flashnb import exercises

exercises._load_all()
# notebook 09's exercises train a PyTorch model: they run where the optional torch extra is installed
HAVE_TORCH = importlib.util.find_spec("torch") is not None
IDS = sorted((i for i in exercises.EXERCISES if HAVE_TORCH or not i.startswith("09.")),
             key=lambda i: tuple(int(x) for x in i.split(".")))
WRONG = [(i, n) for i in IDS for n in range(len(exercises.EXERCISES[i].wrong))]

pytestmark = pytest.mark.skipif(flashnb.MODE != "sim", reason="the checks run kernels on the simulator")


@pytest.mark.parametrize("id", IDS)
def test_solution_passes(id, capsys):
    ex = exercises.EXERCISES[id]
    assert ex.solution is not None, f"exercise {id} has no worked solution"
    assert exercises.check(id, strict=True, **ex.solution())
    assert f"✓ exercise {id}" in capsys.readouterr().out


@pytest.mark.parametrize("id, n", WRONG)
def test_wrong_answer_fails(id, n, capsys):
    # the non-strict check returns False and prints a cross only when the check raised Wrong (any other
    # exception propagates), so one run shows the answer is caught; strict mode is tested once, below
    ex = exercises.EXERCISES[id]
    assert not exercises.check(id, **ex.wrong[n]())
    assert f"✗ exercise {id}" in capsys.readouterr().out


def test_strict_check_raises_wrong(capsys):
    ex = exercises.EXERCISES["03.1"]
    with pytest.raises(exercises.Wrong, match="exercise 03.1"):
        exercises.check("03.1", strict=True, **ex.wrong[0]())
    assert "✗" not in capsys.readouterr().out


def test_every_exercise_has_a_wrong_answer_a_tag_and_an_explanation():
    for id in IDS:
        ex = exercises.EXERCISES[id]
        assert ex.wrong, f"exercise {id}: add at least one typical wrong answer (@check.fails)"
        assert ex.explain and ex.level in (1, 2, 3) and ex.minutes > 0, id


def test_not_attempted_is_not_a_failure(capsys):
    assert exercises.check("00.1", N_h100=..., N_a100=...) is False
    assert "not attempted yet" in capsys.readouterr().out


def test_answer_and_hint_print(capsys):
    exercises.answer("00.3")
    out = capsys.readouterr().out
    assert "def _():" in out and "sectors" in out
    exercises.hint("00.3")
    assert "32-byte" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no exercise"):
        exercises.check("00.99", x=1)


def _kernel_answers():
    """(exercise id, answer name, kernel, signature) of every kernel in a solution or a wrong answer; a kernel
    factory made with registry.variant is built with the original's last registered config and signature."""
    from flashnb import registry

    out = []
    for id in IDS:
        ex = exercises.EXERCISES[id]
        for n, make in enumerate([ex.solution, *ex.wrong]):
            if (id, n - 1) in MEANT_NOT_TO_COMPILE:
                continue
            for name, value in make().items():
                if hasattr(value, "py_func") or type(value).__name__ == "FakeCUDAKernel":
                    assert name in ex.signatures, f"exercise {id}: give the launch signature of answer {name!r}"
                    out.append((id, name, value, ex.signatures[name]))
                elif hasattr(value, "variant_of"):
                    spec = registry._spec_of(value.variant_of)
                    assert spec is not None, f"exercise {id}: {name!r} is a variant of an unregistered factory"
                    config = spec.configs[-1]
                    out.append((id, name, value(**config), spec.signature_for(config)))
    return out


# (exercise id, wrong answer index) of the wrong answers whose fault is that the kernel does not pass the guard
# (05.6's float64 arithmetic): they are checked to fail it, below, instead of to pass it
MEANT_NOT_TO_COMPILE = {("05.6", 3)}


@pytest.mark.slow   # ~40 s of NVVM: run `pytest -m slow tests/exercises/test_exercises.py` after changing one
def test_exercise_kernels_pass_the_ptx_guard():
    # like every kernel in the package (tests/instruments/test_ptx_guard.py), the kernels of the worked solutions and
    # of the wrong answers compile for sm_80 and sm_90 with no float64, shared memory within 48 KiB and no spills
    from flashnb import instruments as fi

    items = _kernel_answers()
    assert items, "no exercise kernels found"
    results = fi.resources_of([(k, sig, cc) for _, _, k, sig in items for cc in ((8, 0), (9, 0))], keep_ptx=False)
    problems = [p for r in results for p in fi.problems(r)]
    assert not problems, problems
    for id, n in sorted(MEANT_NOT_TO_COMPILE):
        kernel = exercises.EXERCISES[id].wrong[n]()["kernel"]
        sig = exercises.EXERCISES[id].signatures["kernel"]
        found = [p for r in fi.resources_of([(kernel, sig, (8, 0))], keep_ptx=False) for p in fi.problems(r)]
        assert any(".f64" in p for p in found), (id, n, found)


def test_answers_by_position(capsys):
    """Before: a positional answer was a bare 'takes 1 positional argument' TypeError.  Positional answers are read
    in the check's order (two answers here, so the order matters: swapped, they fail), and a clash or a surplus is a
    TypeError naming the answers."""
    ex = exercises.EXERCISES["00.1"]
    sol = ex.solution()
    names = list(sol)
    assert len(names) == 2
    assert exercises.check("00.1", *(sol[n] for n in names), strict=True)
    assert "✓ exercise 00.1" in capsys.readouterr().out
    assert not exercises.check("00.1", *(sol[n] for n in reversed(names)))
    assert "✗ exercise 00.1" in capsys.readouterr().out
    assert exercises.check("00.1", sol[names[0]], **{names[1]: sol[names[1]]}, strict=True)
    with pytest.raises(TypeError, match=rf"answer\(s\) \['{names[0]}'\] given both by position and by name"):
        exercises.check("00.1", sol[names[0]], **sol)
    with pytest.raises(TypeError, match=r"exercise 00.1 takes 2 answer\(s\).*got 3 positional"):
        exercises.check("00.1", 1, 2, 3)
    assert exercises.check("00.1", ..., ...) is False and "not attempted yet" in capsys.readouterr().out
