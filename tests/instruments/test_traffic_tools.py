"""Using one's own counts: check them against one's own model (exact or within a budget, naming what differs),
exact bytes in the table, CSV / records / DataFrame export, a roofline point and modelled time from a count."""

import csv
import io
import math

import numpy as np
import pytest
from numba import cuda, float32

import flashnb
from flashnb import common
from flashnb.instruments import roofline, traffic

pytestmark = pytest.mark.skipif(not flashnb.is_simulator(), reason="traffic counting needs the simulator")


@cuda.jit
def scale_rows(X, Y, s):
    """Y[i, :] = s * X[i, :] through a shared tile: one read of X and one write of Y per element."""
    tile = cuda.shared.array(32, float32)
    i, j = cuda.blockIdx.x, cuda.threadIdx.x
    if j < X.shape[1]:
        tile[j] = X[i, j]
        Y[i, j] = s * tile[j]


def model(N, d):
    """My own model of scale_rows, in the format of CONTRIBUTING.md."""
    return [dict(launch="Y = sX", reads={"X": N * d}, writes={"Y": N * d}, atomics={}, shared_reads=N * d,
                 shared_writes=N * d)]


def counted(rng, N=13, d=32):
    x = common.to_device(rng.standard_normal((N, d)))
    y = common.empty((N, d))
    with traffic.count() as t:
        common.launch(scale_rows, N, 32, x, y, 2.0, label="Y = sX")
    return t


def test_check_model_exact_and_what_differs(rng):
    t = counted(rng)
    assert t.check_model(model(13, 32)) == []
    wrong = model(13, 32)
    wrong[0]["reads"]["X"] = 13 * 30
    wrong[0]["shared_reads"] = 0
    with pytest.raises(traffic.ModelMismatch) as err:
        t.check_model(wrong)
    diffs = err.value.differences
    assert diffs[0] == ("launch 0 'Y = sX' (kernel scale_rows): reads of 'X': counted 416, model 390 (+6.7%)")
    assert diffs[1].startswith("launch 0 'Y = sX' (kernel scale_rows): shared_reads: counted 416 (tile 416), model 0")
    assert "not match the model exactly" in str(err.value)


def test_check_model_budget_launch_count_and_labels(rng):
    t = counted(rng)
    near = model(13, 32)
    near[0]["writes"]["Y"] = 400          # counted 416: 4 % more
    assert t.check_model(near, budget=0.05) == []
    assert t.check_model(near, budget=0.03, raise_on_mismatch=False) == [
        "launch 0 'Y = sX' (kernel scale_rows): writes of 'Y': counted 416, model 400 (+4.0%)"]
    two = model(13, 32) + [dict(model(13, 32)[0], launch="again")]
    assert t.check_model(two, raise_on_mismatch=False)[0].startswith("1 launches counted ['Y = sX'], 2 in the model")
    relabelled = [dict(model(13, 32)[0], launch="other")]
    assert "the model's launch 0 is 'other'" in t.check_model(relabelled, raise_on_mismatch=False)[0]
    assert t.check_model(model(13, 32)[0]) == []       # a single launch's dict is accepted too
    for bad in (-0.1, True, "5%"):
        with pytest.raises(ValueError, match="budget"):
            t.check_model(model(13, 32), budget=bad)
    with pytest.raises(ValueError, match="model\\[0\\]"):
        t.check_model([{"reads": {}}])


def test_check_model_on_a_flashnb_kernel(rng):
    # the same helper checks flashnb's own models (fa2 forward, one head, N = 32, d = 16)
    q, k, v = (rng.standard_normal((32, 16)) for _ in range(3))
    with traffic.count() as t:
        flashnb.attention(q, k, v, impl="fa2")
    assert t.check_model(flashnb.stages.fa2.model_forward(1, 32, 32, 16)) == []


def test_table_shows_exact_bytes(rng):
    t = counted(rng)               # 416 elements x 4 B = 1,664 B, printed "1.6 KiB" before
    text = str(t)
    assert "1,664 B (1.6 KiB) read, 1,664 B (1.6 KiB) written" in text
    row = next(line for line in text.splitlines() if line.split()[:1] == ["Y"] or " X " in line)
    assert row.split()[-2:] == ["1,664", "0"]


def test_records_csv_and_dataframe(rng, tmp_path):
    t = counted(rng)
    recs = t.to_records()
    assert [r["array"] for r in recs] == ["X", "Y", "tile"]
    assert recs[0] == dict(launch_index=0, launch="Y = sX", kernel="scale_rows", grid="(13)", block="(32)",
                           array="X", kind="global", itemsize=4, reads=416, writes=0, atomics=0, read_bytes=1664,
                           write_bytes=0, atomic_bytes=0)
    assert recs[2]["kind"] == "shared" and recs[2]["read_bytes"] is None and recs[2]["reads"] == 416
    path = tmp_path / "traffic.csv"
    text = t.to_csv(path)
    assert path.read_text() == text
    rows = list(csv.DictReader(io.StringIO(text)))
    assert tuple(rows[0]) == traffic.RECORD_FIELDS and rows[1]["write_bytes"] == "1664" and rows[2]["read_bytes"] == ""
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs pandas"):
            t.to_dataframe()
    else:
        df = t.to_dataframe()
        assert list(df.columns) == list(traffic.RECORD_FIELDS) and df["reads"].sum() == 3 * 416


def test_roofline_point_and_modelled_time_from_a_count(rng):
    t = counted(rng)
    flops = 416.0                      # one multiply per element
    assert t.global_bytes == 2 * 1664
    point = t.roofline_point(flops, label="scale_rows")
    assert point == dict(label="scale_rows", flops=416.0, bytes=3328.0)
    roofline.roofline_plot([point])    # accepted as is
    mt = t.modelled_time(flops, "H100 SXM")
    assert mt.bytes == 3328 and mt.bound == "memory"
    assert math.isclose(mt.seconds, 3328 / 3.35e12)
    with pytest.raises(ValueError, match="flops"):
        t.roofline_point(-1)


def test_small_modelled_times_use_units_that_fit():
    # 3328 B at 3.35 TB/s is 0.99 ns: printed "0.000 ms" before
    assert str(roofline.modelled_time(416, 3328)).startswith("modelled 0.993 ns on H100 SXM (memory-bound")
    assert " µs on " in str(roofline.modelled_time(0, 3.35e7))          # 10 µs
    assert str(roofline.modelled_time(0, 3.35e10)).startswith("modelled 10.000 ms")   # unchanged from 1 ms up
    np.testing.assert_allclose(roofline.modelled_time(0, 3.35e10).seconds, 0.01)


@cuda.jit
def shared_histogram(x, hist):
    """Each thread adds its element to one of 4 shared bins (shared atomics), thread 0 writes the bins out."""
    bins = cuda.shared.array(4, float32)
    t = cuda.threadIdx.x
    if t < 4:
        bins[t] = float32(0)
    cuda.syncthreads()
    cuda.atomic.add(bins, t % 4, x[t])
    cuda.syncthreads()
    if t < 4:
        hist[t] = bins[t]


def test_check_model_refuses_unknown_keys_and_checks_shared_atomics(rng):
    x = common.to_device(rng.standard_normal(32))
    hist = common.empty(4)
    with traffic.count() as t:
        common.launch(shared_histogram, 1, 32, x, hist, label="histogram")
    mine = dict(launch="histogram", reads={"x": 32}, writes={"hist": 4}, atomics={}, shared_reads=4,
                shared_writes=4, shared_atomics=32)
    assert t.summary() == [mine]             # the seventh key appears because this launch has shared atomics
    assert t.check_model(mine) == []
    assert "32 atomics" in str(t).splitlines()[0]
    # a model that forgets the shared atomics is told so (it was silently accepted before)
    forgot = {k: v for k, v in mine.items() if k != "shared_atomics"}
    assert t.check_model(forgot, raise_on_mismatch=False) == [
        "launch 0 'histogram' (kernel shared_histogram): shared_atomics: counted 32 (bins 32), model 0 (model 0)"]
    # a misspelt key is an error naming it, not a count that nobody checks
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['shared_read'\]"):
        t.check_model(dict(mine, shared_read=4))
