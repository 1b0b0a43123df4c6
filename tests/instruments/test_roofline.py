"""The roofline model: presets consistent with their clocks, bound selection, FLOP formulas, the plot."""

import pytest

from flashnb.instruments import roofline as rl


def test_fp32_peaks_follow_from_sm_count_and_clock():
    # A100: 108 SMs x 64 lanes x 2 x 1.41 GHz = 19.49 TF; H100/H200: 132 x 128 x 2 x 1.98 GHz = 66.9 TF
    for g in rl.GPUS.values():
        assert g.fp32_peak_from_clock == pytest.approx(g.fp32_peak, rel=0.01), g.name


def test_tensor_peaks_follow_from_the_per_sm_rates():
    # dense FP16 = SMs x FMA/clk/SM x 2 x clock: A100 108 x 1024 x 2 x 1.41 GHz = 311.9 TF (the boost clock);
    # T4 40 x 512 x 2 x 1.59 GHz = 65.1 TF; H100 132 x 2048 x 2 x 1.83 GHz = 989 TF (not its 1.98 GHz FP32 clock)
    a, h, t = rl.GPUS["A100 80GB SXM"], rl.GPUS["H100 SXM"], rl.GPUS["T4"]
    assert a.tensor_clock_hz == pytest.approx(a.boost_clock_hz, rel=0.01)
    assert t.tensor_clock_hz == pytest.approx(t.boost_clock_hz, rel=0.01)
    assert h.tensor_clock_hz == pytest.approx(1.83e9, rel=0.01)
    for g in rl.GPUS.values():
        assert g.tensor_tf32_dense in (0.0, pytest.approx(g.tensor_fp16_dense / 2, rel=0.01)), g.name
    assert rl.modelled_time(312e12, 1.0, a, peak="tensor_fp16").seconds == pytest.approx(1.0)
    with pytest.raises(ValueError, match="T4 has no tensor_tf32 peak"):
        rl.modelled_time(1.0, 1.0, t, peak="tensor_tf32")
    with pytest.raises(ValueError, match="peak must be one of"):
        a.peak("int8")


def test_presets():
    assert rl.GPUS["A100 40GB SXM"].hbm_bandwidth == 1555e9
    assert rl.GPUS["A100 80GB SXM"].hbm_bandwidth == 2039e9
    assert rl.GPUS["H100 SXM"].sm_count == rl.GPUS["H200"].sm_count == 132
    assert rl.GPUS["H200"].hbm_bandwidth == 4.8e12


def test_bound_selection():
    h = rl.GPUS["H100 SXM"]
    mem = rl.modelled_time(1e9, 1e9, h)           # 1 FLOP/B, far left of the ridge (20 FLOP/B)
    assert mem.bound == "memory" and mem.seconds == pytest.approx(1e9 / 3.35e12) and mem.kind == "modelled"
    comp = rl.modelled_time(1e12, 1e9, "H100 SXM")  # 1000 FLOP/B
    assert comp.bound == "compute" and comp.seconds == pytest.approx(1e12 / 67e12)
    assert "modelled" in str(comp)
    ridge = h.ridge_intensity
    assert rl.modelled_time(ridge * 1e9, 1e9, h).compute_seconds == pytest.approx(1e9 / h.hbm_bandwidth)


def test_flop_formulas():
    f = rl.flops_forward(2, 4, 1024, 1024, 64)
    assert f == 4 * 2 * 4 * 1024 * 1024 * 64
    assert rl.flops_forward(2, 4, 1024, 1024, 64, causal=True) == f / 2
    assert rl.flops_backward(2, 4, 1024, 1024, 64) == 2.5 * f


def test_bad_inputs():
    with pytest.raises(ValueError, match="gpu"):
        rl.modelled_time(1, 1, "V100")
    with pytest.raises(ValueError, match="bytes"):
        rl.modelled_time(1, -1, "H200")
    with pytest.raises(ValueError, match="Nq"):
        rl.flops_forward(1, 1, 0, 1, 1)


def test_plot_is_labelled_modelled():
    ax = rl.roofline_plot([("naive", 1e9, 4e8), rl.modelled_time(1e12, 1e9, "H200")], "H200")
    assert "modelled" in ax.get_title() and "modelled" in ax.get_ylabel()
    assert len(ax.lines) >= 3
