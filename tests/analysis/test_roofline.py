"""The roofline cost model: lecture numbers, regimes, the adaptive-k policy, validation."""

import dataclasses
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from specjax.engine.adaptive import roofline_k as adaptive_k
from specjax.analysis import roofline as rl
from specjax.analysis import theory

H100 = rl.H100
LECTURE = rl.Workload.lecture_7b()  # 640-token contexts, 128 KiB KV per token
# The lecture's rounded "0.082 GB per sequence" at 640 tokens (instead of 0.0839 GB).
LECTURE_082 = dataclasses.replace(LECTURE, kv_bytes_per_token=0.082e9 / 640)
ALPHA, K, C = 0.8, 4, 0.15


# ----------------------------------------------------------------------------- lecture numbers


def test_lecture_parameters():
  assert H100.bandwidth == 3.35e12 and H100.flops == 494.5e12
  assert LECTURE.weight_bytes == 13.5e9 and LECTURE.flops() == 13.48e9
  assert LECTURE.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # GQA-8, bf16: 128 KiB
  assert LECTURE.kv_bytes_per_seq() / 1e9 == pytest.approx(0.0839, abs=1e-4)  # lecture: 0.082
  assert rl.cache_budget(H100, LECTURE) == pytest.approx(62.5e9)  # 0.95·80 − 13.5 GB


def test_lecture_batch1_step_is_4ms_and_uses_1_in_295_of_the_chip():
  t = rl.step_time(H100, LECTURE, 1, 1)
  assert t == pytest.approx(4.05e-3, abs=0.01e-3)  # weights 4.03 ms + one cache 0.025 ms
  assert rl.memory_time(H100, dataclasses.replace(LECTURE, kv_bytes_per_token=0), 1) == \
      pytest.approx(13.5 / 3.35 * 1e-3)
  assert (13.5e9 / H100.bandwidth) / (13.48e9 / H100.peak_flops) == pytest.approx(295, abs=1)


def test_lecture_gain_at_batch_1_is_2_10():
  for dc in ("full", "memory_only"):
    g = rl.gain(H100, LECTURE, 1, ALPHA, K, C, dc)
    assert g == pytest.approx(theory.speedup(ALPHA, K, C))
    assert round(g, 2) == 2.10
  # Verification only (draft free): the whole E[τ].
  assert rl.gain(H100, LECTURE, 1, ALPHA, K, C, "verify_only") == pytest.approx(3.3616)


def test_lecture_gain_at_batch_164():
  # Formula with 128 KiB/token: 1.224 (lecture: 1.21) counting verification only.
  g = rl.gain(H100, LECTURE, 164, ALPHA, K, C, "verify_only")
  assert g == pytest.approx(1.2236, abs=5e-4)
  assert rl.gain(H100, LECTURE, 164, ALPHA, K, C, "memory_only") == pytest.approx(g)
  # The lecture's 1.21 comes out with its rounded 0.082 GB per sequence ...
  assert round(rl.gain(H100, LECTURE_082, 164, ALPHA, K, C, "verify_only"), 2) == 1.21
  # ... where B = 164 is the batch whose caches weigh as much as the weights (13.5/0.082).
  assert math.floor(13.5e9 / LECTURE_082.kv_bytes_per_seq()) == 164
  # Counting the draft (k·c plain steps) there is no gain left at B = 164.
  assert rl.gain(H100, LECTURE, 164, ALPHA, K, C, "full") == pytest.approx(1.004, abs=1e-3)


def test_lecture_break_even_batch():
  # Formula at k = 4: 259.9 (verify only), 165.7 (draft counted). The lecture says ~324.
  be = {dc: rl.break_even_batch(H100, LECTURE, ALPHA, K, C, dc) for dc in rl.DRAFT_COSTS}
  assert be["verify_only"] == pytest.approx(259.9, abs=0.1)
  assert be["memory_only"] == pytest.approx(259.9, abs=0.1)
  assert be["full"] == pytest.approx(165.7, abs=0.1)
  for dc, b in be.items():
    assert rl.gain(H100, LECTURE, b, ALPHA, K, C, dc) == pytest.approx(1.0, abs=1e-6)
  # ~324 is what k = 3 gives with the lecture's 0.082 GB per sequence (323.4).
  assert rl.break_even_batch(H100, LECTURE_082, ALPHA, 3, C, "verify_only") == \
      pytest.approx(323.4, abs=0.1)


def test_lecture_16k_context():
  lc = rl.long_context(H100, LECTURE, 16384, ALPHA, K, C)
  assert lc.memory_budget == pytest.approx(62.5e9)
  assert lc.batch == 29
  assert lc.memory_bound_verify == pytest.approx(5.72, abs=0.005)  # lecture: ~5.7×
  assert lc.gain["full"] == pytest.approx(theory.speedup(ALPHA, K, C))  # the full gain returns


# ----------------------------------------------------------------------------- the model


def test_step_time_regimes():
  # Memory-bound: t = (W + B·L·kv)/BW; compute-bound: T·B·F/FLOPS.
  b = 4
  assert rl.step_time(H100, LECTURE, b, 1) == pytest.approx(
      (13.5e9 + b * 640 * 131072) / 3.35e12)
  b = 2000
  assert rl.step_time(H100, LECTURE, b, 5) == pytest.approx(5 * b * 13.48e9 / 494.5e12)
  assert rl.memory_bound_factor(H100, LECTURE, b, 5) < 1


def test_gain_is_flat_then_falls():
  bs = np.arange(1, 600)
  g = np.array([rl.gain(H100, LECTURE, float(b), ALPHA, K, C) for b in bs])
  assert np.all(np.diff(g) <= 1e-12)
  crossover = (13.5e9 / 3.35e12) / (5 * 13.48e9 / 494.5e12 - 640 * 131072 / 3.35e12)
  assert np.allclose(g[bs < crossover], g[0])
  assert g[-1] < 1


def test_best_k_is_a_brute_force_argmax_and_turns_off():
  for b in (1, 20, 40, 64, 128, 300, 600):
    gains = [1.0] + [rl.gain(H100, LECTURE, b, ALPHA, k, C) for k in range(1, 9)]
    k, g = rl.best_k(H100, LECTURE, b, ALPHA, C, k_max=8)
    assert k == int(np.argmax(gains)) and g == pytest.approx(max(gains))
  assert rl.best_k(H100, LECTURE, 1, ALPHA, C)[0] == theory.optimal_k(ALPHA, C)[0]
  assert rl.best_k(H100, LECTURE, 2000, ALPHA, C) == (0, 1.0)
  assert rl.gain(H100, LECTURE, 500, ALPHA, 0, C) == 1.0


def test_byte_savings_lower_the_break_even():
  half = dataclasses.replace(LECTURE, weight_bytes=LECTURE.weight_bytes / 2)  # e.g. int8
  assert rl.break_even_batch(H100, half, ALPHA, K, C) < rl.break_even_batch(H100, LECTURE,
                                                                             ALPHA, K, C)


def test_presets():
  assert rl.HARDWARE["h200"].bandwidth == 4.8e12 and rl.HARDWARE["h200"].memory == 141e9
  assert rl.HARDWARE["a100"].flops < rl.HARDWARE["h100"].flops
  # Same compute, more bandwidth: the step turns compute-bound at a smaller batch, so
  # speculation stops paying sooner on an H200 than on an H100.
  assert rl.break_even_batch(rl.H200, LECTURE, ALPHA, K, C) < rl.break_even_batch(
      H100, LECTURE, ALPHA, K, C)


# ----------------------------------------------------------------------------- adaptive k


@pytest.mark.parametrize("hw", [rl.H100, rl.H200, rl.A100])
@pytest.mark.parametrize("alpha,c,draft_cost", [(0.8, 0.15, "full"), (0.95, 0.05, "verify_only"),
                                                (0.6, 0.3, "memory_only"), (0.9, 0.0, "full")])
def test_adaptive_policy_is_monotone_and_follows_best_k(hw, alpha, c, draft_cost):
  policy = adaptive_k.AdaptiveKPolicy(hw, LECTURE, alpha, c, k_max=8, max_batch=2048,
                              draft_cost=draft_cost)
  ks = [policy.k_for_batch(b) for b in range(1, 2049)]
  assert all(a >= b for a, b in zip(ks, ks[1:]))
  assert ks[0] == rl.best_k(hw, LECTURE, 1, alpha, c, 8, draft_cost)[0]
  for b in (1, 50, 300, 2048):  # where the raw optimum is monotone, the policy is it
    assert policy.k_for_batch(b) <= rl.best_k(hw, LECTURE, b, alpha, c, 8, draft_cost)[0]


def test_adaptive_policy_lecture_table():
  policy = adaptive_k.AdaptiveKPolicy(H100, LECTURE, ALPHA, C)
  assert policy.breakpoints() == [(1, 5), (30, 4), (39, 3), (56, 2), (101, 1), (504, 0)]
  assert policy.table([1, 64, 4096, 10**6]) == [(1, 5), (64, 2), (4096, 0), (10**6, 0)]
  assert hash(policy) == hash(adaptive_k.AdaptiveKPolicy(H100, LECTURE, ALPHA, C))
  with pytest.raises(dataclasses.FrozenInstanceError):
    policy.alpha = 0.5
  with pytest.raises(ValueError, match="batch"):
    policy.k_for_batch(0)


# ----------------------------------------------------------------------------- workloads


@dataclasses.dataclass(frozen=True)
class _Cfg:  # a stand-in with ModelConfig's fields (duck typing)
  vocab_size: int = 50257
  d_model: int = 768
  n_layers: int = 12
  n_heads: int = 12
  n_kv_heads: int = 12
  d_ff: int = 3072
  max_len: int = 1024
  norm: str = "layernorm"
  positions: str = "learned"
  rope_theta: float = 10000.0
  mlp: str = "gelu"
  tie_embeddings: bool = True
  use_bias: bool = True
  dtype: str = "float32"

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


def test_gpt2_small_counts():
  cfg = _Cfg()
  assert rl.param_counts(cfg)["total"] == 124_439_808  # GPT-2 small
  wl = rl.Workload.from_model_config(cfg, context_len=512)
  assert wl.weight_bytes == 124_439_808 * 4
  assert wl.kv_bytes_per_token == 2 * 12 * 12 * 64 * 4
  assert wl.flops_per_token == 2 * (12 * (4 * 768 * 768 + 2 * 768 * 3072) + 50257 * 768)
  assert wl.flops() == wl.flops_per_token + 4 * 12 * 768 * 512
  bf16 = rl.Workload.from_model_config(cfg, 512, dtype_bytes=2, attention_flops=False)
  assert bf16.weight_bytes == wl.weight_bytes / 2 and bf16.flops() == wl.flops_per_token


def test_llama2_7b_config_gives_the_lecture_weight_bytes():
  cfg = _Cfg(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
             d_ff=11008, max_len=4096, norm="rmsnorm", positions="rope", mlp="swiglu",
             tie_embeddings=False, use_bias=False, dtype="bfloat16")
  assert rl.param_counts(cfg)["total"] == 6_738_415_616
  wl = rl.Workload.from_model_config(cfg, 640)
  assert wl.weight_bytes / 1e9 == pytest.approx(13.48, abs=0.01)  # lecture: 13.5 GB
  gqa8 = rl.Workload.from_model_config(dataclasses.replace(cfg, n_kv_heads=8), 640)
  assert gqa8.kv_bytes_per_token == LECTURE.kv_bytes_per_token


@pytest.mark.parametrize("overrides", [
    {}, {"mlp": "swiglu", "norm": "rmsnorm", "positions": "rope", "use_bias": False,
         "n_kv_heads": 2, "tie_embeddings": False}, {"qkv_bias": True, "use_bias": False},
    {"mlp": "swiglu", "norm": "rmsnorm", "positions": "rope", "use_bias": False,
     "qk_norm": True, "head_dim_override": 48, "n_kv_heads": 2}])
def test_param_counts_match_the_transformer(overrides):
  transformer = pytest.importorskip("specjax.models.transformer")
  base = dict(n_layers=2, d_model=128, n_heads=4, n_kv_heads=4, d_ff=256, vocab_size=1000,
              max_len=64)
  cfg = transformer.ModelConfig.gpt2(**{**base, **overrides})
  assert rl.param_counts(cfg)["total"] == transformer.param_count(cfg)


def test_from_numbers():
  wl = rl.Workload.from_numbers(6.74e9, 131072, 640)
  assert wl.weight_bytes == pytest.approx(13.48e9) and wl.flops() == pytest.approx(13.48e9)


# ----------------------------------------------------------------------------- memory


def test_max_batch_and_draft_kv():
  budget = rl.cache_budget(H100, LECTURE)
  assert rl.max_batch(LECTURE, budget) == 745
  none = rl.draft_kv_cost(H100, LECTURE, ALPHA, K, C, draft_kv_bytes_per_token=0)
  assert none.batch_spec == none.batch_plain == 745
  assert none.gain_at_capacity == pytest.approx(rl.gain(H100, LECTURE, 745, ALPHA, K, C))
  d = rl.draft_kv_cost(H100, LECTURE, ALPHA, K, C, draft_kv_bytes_per_token=13107.2,
                       draft_weight_bytes=1.35e9)
  assert d.batch_spec == math.floor((62.5e9 - 1.35e9) / (640 * 1.1 * 131072))
  assert d.concurrency_lost == pytest.approx(1 - d.batch_spec / 745)
  assert d.gain_at_capacity < 1  # a full server is compute-bound: speculation loses


def test_long_context_with_a_smaller_budget():
  lc = rl.long_context(H100, LECTURE, 16384, ALPHA, K, C, memory_budget=10e9)
  assert lc.batch == 4
  with pytest.raises(ValueError, match="context_len"):
    rl.long_context(H100, LECTURE, 16384, ALPHA, K, C, memory_budget=1e9)


# ----------------------------------------------------------------------------- calibration


def test_calibrate_measures_something_plausible():
  hw = rl.calibrate(stream_bytes=8 * 2**20, matmul_size=256, repeats=2)
  assert hw.bandwidth > 1e8 and hw.flops > 1e8 and hw.memory > 1e8
  assert rl.step_time(hw, LECTURE, 1) > 0


def test_roofline_imports_without_jax():
  code = ("import sys, specjax.analysis.roofline; "
          "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
  subprocess.run([sys.executable, "-c", code], check=True,
                 cwd=pathlib.Path(__file__).resolve().parents[2])


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("call,name", [
    (lambda: rl.step_time(H100, LECTURE, 0, 1), "batch"),
    (lambda: rl.step_time(H100, LECTURE, float("nan"), 1), "batch"),
    (lambda: rl.step_time(H100, LECTURE, 1, 0), "tokens_per_seq"),
    (lambda: rl.gain(H100, LECTURE, 0.5, ALPHA, K, C), "batch"),
    (lambda: rl.gain(H100, LECTURE, 1, 1.2, K, C), "alpha"),
    (lambda: rl.gain(H100, LECTURE, 1, ALPHA, -1, C), "k"),
    (lambda: rl.gain(H100, LECTURE, 1, ALPHA, K, -0.1), "c"),
    (lambda: rl.gain(H100, LECTURE, 1, ALPHA, K, float("inf")), "c"),
    (lambda: rl.gain(H100, LECTURE, 1, ALPHA, K, C, "some"), "draft_cost"),
    (lambda: rl.best_k(H100, LECTURE, 1, ALPHA, C, k_max=-1), "k_max"),
    (lambda: rl.break_even_batch(H100, LECTURE, float("nan"), K, C), "alpha"),
    (lambda: rl.Hardware("x", bandwidth=-1.0, flops=1.0, memory=1.0), "bandwidth"),
    (lambda: rl.Hardware("x", bandwidth=1.0, flops=float("inf"), memory=1.0), "flops"),
    (lambda: rl.Workload("x", 1.0, 1.0, 1.0, context_len=0), "context_len"),
    (lambda: rl.Workload("x", -1.0, 1.0, 1.0, context_len=8), "weight_bytes"),
    (lambda: rl.max_batch(LECTURE, -5.0), "memory_budget"),
    (lambda: adaptive_k.AdaptiveKPolicy(H100, LECTURE, 1.5, C), "alpha"),
    (lambda: adaptive_k.AdaptiveKPolicy(H100, LECTURE, ALPHA, C, max_batch=0), "max_batch"),
    (lambda: rl.cache_budget(H100, dataclasses.replace(LECTURE, weight_bytes=90e9)), "weights"),
])
def test_bad_input_raises_naming_the_argument(call, name):
  with pytest.raises(ValueError, match=name):
    call()
