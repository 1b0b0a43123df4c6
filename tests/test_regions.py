"""flashnb.regions: named regions of kernel source (markers, function bodies), and the clear errors a missing,
duplicated, unbalanced or wrongly nested region gives -- through the module, registry.variant and the course."""

import pytest

from flashnb import regions, registry
from flashnb.course import build
from flashnb.stages import fa1, naive, softmax

SOURCE = '''\
def make(T):
    x = 1
    # region outer
    y = 2
    # region inner
    z = 3
    # endregion inner
    # endregion outer

    def helper(a):
        """Say what it does."""
        b = a + 1
        return b

    # region tail
    w = 4
    # endregion tail
    return x
'''


def test_regions_are_listed_in_order_and_their_bodies_replaced():
    assert regions.names(SOURCE) == ["outer", "inner", "tail"]
    assert regions.body(SOURCE, "inner") == "    z = 3\n"
    assert regions.body(SOURCE, "outer") == "    y = 2\n    # region inner\n    z = 3\n    # endregion inner\n"
    # a body written without indentation is indented like the region; the markers stay
    new = regions.replace_body(SOURCE, "tail", "w = 5\nv = 6")
    assert "    # region tail\n    w = 5\n    v = 6\n    # endregion tail\n" in new
    # an indented body is kept as written (so it can leave a loop)
    assert "  q = 1\n" in regions.replace_body(SOURCE, "tail", "  q = 1\n")
    assert regions.replace_in(SOURCE, "outer", "y = 2", "y = 7").count("y = 7") == 1
    assert regions.replace_body(SOURCE, "inner", "").count("# region inner\n    # endregion inner") == 1


def test_a_function_is_a_region_by_its_name_without_its_docstring():
    assert regions.body(SOURCE, "helper") == "        b = a + 1\n        return b\n"
    new = regions.replace_body(SOURCE, "helper", "return a")
    assert '"""Say what it does."""\n        return a\n' in new
    assert regions.find(SOURCE, "helper").kind == "function"


@pytest.mark.parametrize("text, match", [
    (SOURCE.replace("    # endregion tail\n", ""), r"region 'tail' .*opened at line 15 is never closed"),
    (SOURCE.replace("    # region tail\n", ""), r"'# endregion tail' at line \d+ in make closes no open region"),
    (SOURCE.replace("# region tail", "# region inner"), r"region 'inner'.* is marked twice \(lines 5 and 15\)"),
    (SOURCE.replace("    # endregion inner\n    # endregion outer\n", "    # endregion outer\n    # endregion inner\n"),
     r"nested wrongly.*closes 'outer' while region 'inner'"),
    (SOURCE.replace("# region tail", "# region Tail_2"), r"not a region marker.*kebab-case"),
    (SOURCE.replace("    # endregion tail", "# endregion tail"), r"region 'tail'.*indented differently"),
])
def test_broken_markers_are_errors_that_name_the_region(text, match):
    with pytest.raises(regions.RegionError, match=match):
        regions.names(text, "make")


def test_a_missing_region_names_it_and_lists_the_ones_that_exist():
    with pytest.raises(regions.RegionError, match=r"no region 'tial'.*its regions: outer, inner, tail; "
                                                  r"its functions: helper, make"):
        regions.body(SOURCE, "tial")
    with pytest.raises(regions.RegionError, match=r"'x = 9' occurs 0 times in region 'tail'"):
        regions.replace_in(SOURCE, "tail", "x = 9", "x = 8")
    with pytest.raises(regions.RegionError, match=r"'= ' occurs 2 times in region 'outer'"):
        regions.replace_in(SOURCE, "outer", "= ", "=")


def test_variant_addresses_regions_and_names_a_missing_one():
    v = registry.variant(softmax.make_attention_tiles, region="tile-update", replace=("if active:", "if active:  #"))
    assert "if active:  #" in v.variant_source and v.variant_of is softmax.make_attention_tiles
    # a variant of a variant starts from its source, and stays a variant of the registered factory
    w = registry.variant(v, region="tile-update", replace=("if active:  #", "if active:  # again"))
    assert "if active:  # again" in w.variant_source and w.variant_of is softmax.make_attention_tiles
    with pytest.raises(ValueError, match=r"no region 'max-and-summ' .*make_softmax_rows.*its regions: max-and-sum"):
        registry.variant(naive.make_softmax_rows, regions={"max-and-summ": "pass"})
    with pytest.raises(ValueError, match=r"occurs 0 times in region 'scores'"):
        registry.variant(fa1.make_forward, region="scores", replace=("no such text", ""))
    with pytest.raises(ValueError, match=r"occurs \d+ times in make_forward's source.*its names: loop-nest, scores"):
        registry.variant(fa1.make_forward, replace=("cuda.syncthreads()", "pass"))
    with pytest.raises(TypeError, match="without replace="):
        registry.variant(fa1.make_forward, region="scores")
    with pytest.raises(TypeError, match="not both"):
        registry.variant(fa1.make_forward, source="def f(): pass\n", regions={"scores": "pass"})


def test_a_master_todo_of_a_missing_region_is_a_build_error_naming_it():
    source = build._library_source("from flashnb.stages.fa1 import make_forward")
    student, removed = build.cut(source, "statistics", "line 11", "make_forward")
    assert "# region statistics\n                    # TODO: line 11 (about 10 lines)" in student
    assert "# endregion statistics" in student and removed[0].strip().startswith("mn = max(mo, mt)")
    with pytest.raises(build.MasterError, match=r"todo 'statistic': no region 'statistic' .*make_forward.*"
                                                r"its regions: loop-nest, scores, statistics"):
        build.cut(source, "statistic", "line 11", "make_forward")
