"""Spec-Bench on a real model: specjax's drafters beside transformers, same weights, one run.

One point = one question at one temperature (`question`, `temperature`: the sweep's axes,
filled in by benchmarks/real_model.py from a Spec-Bench question file, `per_category`
questions of each category: `select`). The question's first turn is rendered with the
target tokenizer's chat template and decoded at batch 1 for at most `max_new_tokens`,
stopping at every EOS id of the model's files, by every system, alternated `repeats` times
after a warm-up call each (`measure.alternate`), specjax and transformers interleaved:

    specjax plain           `decoding.generate` (the reference of every specjax speedup)
    specjax DRAFT@K         `speculative_generate` with a drafter reference (`resolve`:
                            lookup, layer-skip:M, ...) and K drafts per cycle or K = auto
                            (the adaptive policy), e.g. "lookup@4", "layer-skip:8@auto";
                            K = tree:W1xW2.. a static tree (`trees.branching`: W1 children
                            of the root, W2 of each of those, ...), K = dyn:W1xW2.. EAGLE-2's
                            dynamic tree of the same budget, depth and widest level
                            (`trees.DynamicTree`, scored at `DYN_T0_CONFIDENCE` at T = 0)
    transformers plain      `generate` on the same float32 weights and the same token ids
                            (the reference of every transformers speedup)
    transformers lookup     `generate(prompt_lookup_num_tokens=hf_lookup_tokens)`
    transformers assisted   `generate(assistant_model=...)` with the draft model `hf_draft`
                            (a Hugging Face directory), when there is one

transformers runs with `torch_threads` intra-op threads (2: its best on a small CPU; torch's
spinning workers degrade badly when cores are shared). Per system: new tokens, median
seconds, tokens/s (end to end, prefill included: Spec-Bench's measure), speedup = tokens/s
÷ the same library's plain tokens/s (= plain ÷ speculative seconds when both emitted the
same tokens), τ = mean accepted tokens per verification (transformers: (new tokens − 1) ÷
(target forward passes − 1), counted by a forward hook). specjax's speculative systems also
report α, acceptance by draft position (`depth_tried` / `depth_accepted`: cycles that
tried / accepted a node at depth d, summed over rows; the report pools them over questions),
the decode-phase speedup (each system also timed at max_new_tokens = 1 and that
prefill subtracted) and the calibrated prediction of it (`specjax.calibration`: the compiled
loops' own step and cycle costs, measured once per drafter and temperature on
`calibration_questions` and cached on disk): a chain of K: τ_loop of this run's own
acceptance ÷ the chain's cycle steps (`adaptive.calibrated_prediction`); K = auto: the
tokens emitted ÷ the calibrated steps of the shapes the policy chose, cycle by cycle
(`adaptive_prediction`); a static tree: as a chain; a dynamic tree: its measured τ ÷ the
cycle steps of the static tree of the same widths (the same verified rows and draft passes:
the calibration times static shapes only); `efficiency` = measured ÷ predicted. A K = auto
system runs the adaptive policy priced by that calibration (`auto_policy`), calibrated
before its first timed call.

Checks at T = 0 (float32): every specjax system's tokens equal specjax plain's (else
`divergences`, `only_ties`, as in Spec-Bench's study); transformers' plain tokens against
specjax plain's (`agree_with_transformers`: identical, and where not the first differing
position, both tokens and the ulps between their logits: the two libraries sum in another
order, so a near tie may break either way); transformers' speculative systems against its
plain. Mismatches are reported, never dropped. `loadavg` before and after each point records
the machine's load.
"""

from __future__ import annotations

import functools
import os

from specjax.calibration import loop_costs as calibration, timing
from specjax.engine import decoding
from specjax.engine.adaptive import policy as adaptive
from specjax import resolve
from specjax.verify import sampling, trees
from specjax.experiments import measure
from specjax.experiments import adaptive as adaptive_study
from specjax.experiments import hf_peer
from specjax.experiments.specbench import EMBEDDED_COUNT, EMBEDDED_LEN, _eos_ids
from specjax.data.prompts import EMBEDDED, encode_prompt, load_prompts
from specjax.models.transformer import with_dtype

DEFAULT_SYSTEMS = ("lookup@4", "lookup@auto", "layer-skip:8@4", "layer-skip:15@4")
HF_SYSTEMS = ("plain", "lookup", "assisted")
AUTO_CHAINS = tuple(k for k in adaptive.DEFAULT_CHAINS if k)  # the default menu's chains
DYN_T0_CONFIDENCE = 0.25  # the drafters study's T = 0 scoring temperature of a dynamic tree


# ----------------------------------------------------------------------------- inputs


def select(prompts: str, per_category: int) -> list:
  """The question ids of the first `per_category` questions of each category of a question
  file, categories in the order they first appear, questions in file order."""
  if isinstance(per_category, bool) or not isinstance(per_category, int) or per_category < 1:
    raise ValueError(f"per_category must be an int >= 1, got {per_category!r}")
  chosen: dict[str, list] = {}
  for p in load_prompts(prompts):
    taken = chosen.setdefault(p.category, [])
    if len(taken) < per_category:
      taken.append(p.question_id)
  return [q for ids in chosen.values() for q in ids]


def parse_system(text: str) -> tuple[str, int | str | tuple]:
  """("DRAFT", K) of "DRAFT@K": K an int >= 1, "auto", or ("tree" | "dyn", widths) for
  tree:W1xW2.. / dyn:W1xW2..; the draft reference is checked by `resolve.draft_kind`."""
  draft, sep, k = str(text).rpartition("@")
  shape, _, widths = k.partition(":")
  ws = widths.split("x")
  if shape in ("tree", "dyn") and all(w.isdigit() and int(w) >= 1 for w in ws):
    parsed = (shape, tuple(int(w) for w in ws))
  elif k == "auto" or (k.isdigit() and int(k) >= 1):
    parsed = k if k == "auto" else int(k)
  else:
    parsed = None
  if not sep or not draft or parsed is None:
    raise ValueError(f"systems entry {text!r}: write DRAFT@K with K an int >= 1, 'auto', "
                     f"tree:W1xW2.. or dyn:W1xW2.. (e.g. lookup@4, layer-skip:8@auto, "
                     f"eagle3:DIR@dyn:4x2x2)")
  resolve.draft_kind(draft, flag=f"systems entry {text!r}:")
  return draft, parsed


def shape_of(k, temperature: float = 0.0):
  """The speculation shape of a parsed K: a chain, a static tree or a dynamic tree (None
  for "auto": the policy's)."""
  if k == "auto":
    return None
  if isinstance(k, int):
    return trees.chain(k)
  static = trees.branching(k[1])
  if k[0] == "tree":
    return static
  return trees.DynamicTree(budget=static.size, depth=static.max_depth, width=max(k[1]),
                           confidence=DYN_T0_CONFIDENCE if temperature == 0 else 1.0)


def calibrated_shape(k):
  """The static shape whose calibrated cycle prices K's (a dynamic tree: its static twin)."""
  return trees.chain(k) if isinstance(k, int) else trees.branching(k[1])


def validate(params: dict) -> None:
  for name in ("max_new_tokens", "repeats", "torch_threads", "calibration_repeats",
               "hf_lookup_tokens"):
    if name in params:
      measure.check_int(params, name, None, 1)
  for s in params.get("systems", DEFAULT_SYSTEMS):
    parse_system(s)
  hf = params.get("hf_systems", ("plain", "lookup"))
  for s in hf:
    if s not in HF_SYSTEMS:
      raise ValueError(f"hf_systems entry {s!r} is not one of {HF_SYSTEMS}")
  if "assisted" in hf and not params.get("hf_draft"):
    raise ValueError("hf_systems has 'assisted' but no hf_draft (a draft model's Hugging "
                     "Face directory) is given")
  if hf and "plain" not in hf:
    raise ValueError(f"hf_systems {list(hf)!r} needs 'plain' (every transformers speedup is "
                     f"over its plain generate)")
  sampling.make_sampler(params.get("temperature", 0.0))


def memory(params: dict) -> int:
  return 0  # the engine's own checks (`kv.check_fits`) run when a question is decoded


# ----------------------------------------------------------------------------- models


@functools.lru_cache(maxsize=1)
def _target(ref: str, dtype: str | None):
  """(stored model, served model, tokenizer) of the target, once per process."""
  model, tok = resolve.load_target(ref)
  if dtype is not None:
    return model, with_dtype(model, dtype), tok
  return model, model, tok


@functools.lru_cache(maxsize=None)
def _drafter(ref: str, dtype: str | None, draft: str):
  """The drafter object of a draft reference on the target (`resolve.make_drafter`)."""
  model, serving, tok = _target(ref, dtype)
  net = resolve.draft_model(draft, model, tokenizer=tok)
  return resolve.make_drafter(draft, model, net, serving=serving)[0]


@functools.lru_cache(maxsize=2)
def _hf(ref: str, threads: int):
  import torch
  torch.set_num_threads(threads)
  return hf_peer.load(ref)


@functools.lru_cache(maxsize=None)
def _costs(ref, dtype, draft, ks: tuple, temperature, max_new_tokens, repeats, seed,
           calib_ids: tuple):
  """The calibrated loop costs of `draft` on the target at batch 1 (cached on disk); ks:
  the parsed Ks whose shapes it times (`calibrated_shape`)."""
  _, serving, _ = _target(ref, dtype)
  shapes = list(dict.fromkeys(calibrated_shape(k) for k in ks))
  return calibration.calibrate(serving, _drafter(ref, dtype, draft), [list(i) for i in calib_ids],
                               shapes, batch=1, max_new_tokens=max_new_tokens, repeats=repeats,
                               temperature=temperature, seed=seed)


@functools.lru_cache(maxsize=2)
def _questions(prompts: str, ref: str, dtype: str | None) -> dict:
  """{question_id: Prompt} of a question file (or an embedded set, cut with the target's
  tokenizer as Spec-Bench's study cuts it)."""
  if prompts in EMBEDDED:
    tok = _target(ref, dtype)[2]
    found = load_prompts(prompts, tokenizer=tok, count=EMBEDDED_COUNT, prompt_len=EMBEDDED_LEN)
  else:
    found = load_prompts(prompts)
  return {p.question_id: p for p in found}


def auto_chains(drafter) -> tuple[int, ...]:
  """The chains of the default menu (`AUTO_CHAINS`) this drafter can draft (4 Medusa heads
  draft no chain of 6: `decoding.drafter_menu`)."""
  return tuple(k for k in decoding.drafter_menu(drafter, adaptive.DEFAULT_CHAINS) if k)


def auto_policy(costs: calibration.LoopCosts, drafter) -> adaptive.AdaptivePolicy:
  """The policy a K = auto system runs: the default menu (k = 0 and the chains of
  `auto_chains`) priced by the drafter's calibration at batch 1, its priors from what the
  calibration measured (`AdaptivePolicy.from_costs`), k = 0 with the drafter's catch-up
  share. Without it `k="auto"` runs the uncalibrated `decoding.default_policy`, which prices
  a drafter with no model of its own (prompt lookup) at a full target step per draft pass and
  never speculates."""
  return adaptive.AdaptivePolicy.from_costs((0,) + auto_chains(drafter), {1: costs},
                                            lazy_slots=decoding.lazy_slots_of(drafter))


def adaptive_prediction(costs: calibration.LoopCosts, gen) -> float:
  """The calibrated prediction of an adaptive run at batch 1: the tokens its loop emitted
  after the prefill ÷ the calibrated plain steps it spent: each speculative iteration the
  cycle of the chain it chose, each of its k = 0 tokens (`Generation.plain_steps`; one
  k = 0 iteration may run several) one plain step."""
  steps = float(gen.plain_steps[0]) if gen.plain_steps is not None else 0.0
  for i in gen.choices:
    name = gen.menu[int(i)]
    if name != "k=0":
      steps += costs.cycle_steps(trees.chain(int(name[2:])))
  return (len(gen.tokens[0]) - 1) / steps if steps else float("nan")


# ----------------------------------------------------------------------------- the point


def point(question, temperature: float = 0.0, target: str = "", hf_model: str | None = None,
          prompts: str = "", systems=DEFAULT_SYSTEMS, hf_systems=("plain", "lookup"),
          hf_draft: str | None = None, hf_lookup_tokens: int = 10, hf_assistant_k: int = 4,
          max_new_tokens: int = 128, repeats: int = 2, seed: int = 0, torch_threads: int = 2,
          calibration_questions=None, calibration_repeats: int = 2,
          target_dtype: str | None = "float32", chat_template: bool = True) -> dict:
  load_before = os.getloadavg()
  model, serving, tok = _target(target, target_dtype)
  questions = _questions(prompts, target, target_dtype)
  if question not in questions:
    raise ValueError(f"question {question!r} is not in {prompts}")
  encode = lambda q: encode_prompt(questions[q], tok, use_chat_template=chat_template)
  ids = encode(question)
  eos = _eos_ids(tok)
  common = dict(sampler=sampling.make_sampler(temperature), seed=seed, eos_id=eos)
  parsed = {s: parse_system(s) for s in systems}

  def plain(n):
    return lambda: decoding.generate(serving, [ids], max_new_tokens=n, **common)

  calib_ids = tuple(tuple(encode(q)) for q in (calibration_questions or [question]))

  def costs_of(draft):  # one calibration per drafter: every chain its systems run
    auto = any(d == draft and kk == "auto" for d, kk in parsed.values())
    ks = tuple(sorted({kk for d, kk in parsed.values() if d == draft and kk != "auto"}
                      | (set(auto_chains(_drafter(target, target_dtype, draft))) if auto
                         else set()),
                      key=lambda kk: (isinstance(kk, tuple), str(kk))))
    return _costs(target, target_dtype, draft, ks, float(temperature), max_new_tokens,
                  calibration_repeats, seed, calib_ids)

  def spec(draft, k, n):
    d = _drafter(target, target_dtype, draft)
    if k == "auto":  # the policy priced by this machine's calibration, as the prediction is
      pol = auto_policy(costs_of(draft), d)
      return lambda: decoding.speculative_generate(serving, d, [ids], policy=pol,
                                                   max_new_tokens=n, **common)
    if isinstance(k, int):
      return lambda: decoding.speculative_generate(serving, d, [ids], k=k, max_new_tokens=n,
                                                   **common)
    tree = shape_of(k, temperature)
    return lambda: decoding.speculative_generate(serving, d, [ids], tree=tree,
                                                 max_new_tokens=n, **common)

  fns = {"specjax plain": plain(max_new_tokens)}
  prefill = {"specjax plain": plain(1)}
  hf_names = []
  if hf_systems:
    fns.update(_hf_calls(hf_model or target, hf_systems, hf_draft, hf_lookup_tokens,
                         hf_assistant_k, ids, max_new_tokens, temperature, eos, seed,
                         torch_threads))
    hf_names = [n for n in fns if n.startswith("transformers")]
  for s, (draft, k) in parsed.items():
    fns[f"specjax {s}"] = spec(draft, k, max_new_tokens)
    prefill[f"specjax {s}"] = spec(draft, k, 1)
  timed = measure.alternate({**fns, **{f"{n}/prefill": f for n, f in prefill.items()}},
                            repeats)
  seconds = {n: t.median for n, t in timed.items()}
  out = {}
  base = timed["specjax plain"].result
  base_tok_s = len(base.tokens[0]) / seconds["specjax plain"]
  out["specjax plain"] = {"library": "specjax", "new_tokens": len(base.tokens[0]),
                          "seconds": seconds["specjax plain"], "tok_s": base_tok_s,
                          "speedup": 1.0, "tau": 1.0,
                          "prefill_seconds": seconds["specjax plain/prefill"]}
  for s, (draft, k) in parsed.items():
    name = f"specjax {s}"
    out[name] = _spec_fields(timed[name].result, seconds, name, out["specjax plain"], k,
                             costs_of(draft), temperature, serving, ids, base)
  if hf_names:
    ref = timed["transformers plain"].result
    ref_tok_s = len(ref.tokens) / seconds["transformers plain"]
    for name in hf_names:
      run = timed[name].result
      tok_s = len(run.tokens) / seconds[name]
      out[name] = {"library": "transformers", "new_tokens": len(run.tokens),
                   "seconds": seconds[name], "tok_s": tok_s, "speedup": tok_s / ref_tok_s,
                   "tau": run.tau if name != "transformers plain" else 1.0,
                   "forwards": run.forwards,
                   "identical_to_plain": (run.tokens == ref.tokens) if temperature == 0
                   else None}
  row = {**questions[question].row(), "temperature": temperature, "prompt_tokens": len(ids),
         "eos_ids": eos, "systems": out,
         "loadavg": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
         "torch_threads": torch_threads}
  if temperature == 0 and hf_names:
    row["agree_with_transformers"] = _agreement(serving, ids, base.tokens[0],
                                                timed["transformers plain"].result.tokens)
  return row


def _hf_calls(ref, hf_systems, hf_draft, lookup_tokens, assistant_k, ids, n, temperature,
              eos, seed, threads) -> dict:
  """The timed transformers callables, each with a one-token `warm_up` (nothing compiles)."""
  model = _hf(ref, threads)
  assistant = None
  if "assisted" in hf_systems:
    assistant = _hf(hf_draft, threads)
    hf_peer.pin_assistant(assistant, assistant_k)
  options = {"plain": {}, "lookup": {"lookup_tokens": lookup_tokens},
             "assisted": {"assistant": assistant}}
  out = {}
  for s in hf_systems:
    label = "transformers " + {"lookup": f"lookup({lookup_tokens})",
                               "assisted": f"assisted@{assistant_k}"}.get(s, s)
    kwargs = dict(temperature=temperature, eos_ids=eos, seed=seed, **options[s])
    fn = functools.partial(hf_peer.generate, model, ids, n, **kwargs)
    fn.warm_up = functools.partial(hf_peer.generate, model, ids, 1, **kwargs)
    out[label] = fn
  return out


def _spec_fields(gen, seconds, name, plain, k, costs, temperature, serving, ids, base):
  """A specjax speculative system's fields (module doc)."""
  new = len(gen.tokens[0])
  tok_s = new / seconds[name]
  summary = gen.summary()
  decode = timing.decode_phase(plain["new_tokens"] - 1, new - 1,
                               plain["seconds"] - plain["prefill_seconds"],
                               seconds[name] - seconds[f"{name}/prefill"])
  # decode_phase's ratio is of seconds; with other token counts (T > 0) compare rates
  speedup_decode = (decode["speculative_tokens_per_s"] / decode["plain_tokens_per_s"]
                    if decode else float("nan"))
  if k == "auto":
    predicted = adaptive_prediction(costs, gen)
  elif isinstance(k, tuple) and k[0] == "dyn":
    predicted = costs.predicted_speedup(calibrated_shape(k), summary.tau)
  else:
    predicted = adaptive_study.calibrated_prediction(costs, gen.stats, calibrated_shape(k), 1,
                                                     max(new - 1, 1))
  fields = {"library": "specjax", "new_tokens": new, "seconds": seconds[name], "tok_s": tok_s,
            "speedup": tok_s / plain["tok_s"], "speedup_decode": speedup_decode,
            "predicted_speedup": predicted,
            "efficiency": speedup_decode / predicted if predicted > 0 else float("nan"),
            "tau": summary.tau, "alpha": summary.alpha, "t_step_ms": 1e3 * costs.t_step,
            "calibration_cached": bool(costs.meta.get("cached")),
            "identical_to_plain": (gen.tokens == base.tokens) if temperature == 0 else None}
  if k == "auto":
    fields["choices"] = {n: int((gen.choices == i).sum()) for i, n in enumerate(gen.menu)}
  if "depth_tried" in gen.stats:  # acceptance by draft position: the report pools these
    fields.update(depth_tried=[int(x) for x in gen.stats["depth_tried"].sum(axis=0)],
                  depth_accepted=[int(x) for x in gen.stats["depth_accepted"].sum(axis=0)])
  if temperature == 0 and gen.tokens != base.tokens:
    div = measure.divergences(serving, [ids], base.tokens, gen.tokens)
    fields.update(divergences=div,
                  only_ties=all(d["ulps"] is not None and d["ulps"] <= 2 for d in div))
  return fields


def _agreement(serving, ids, ours: list, theirs: list) -> dict:
  """specjax plain vs transformers' greedy tokens: identical, and where not, the first
  differing position with its logit gap (`measure.divergences`)."""
  if ours == theirs:
    return {"identical": True, "compared": len(ours)}
  div = measure.divergences(serving, [ids], [ours], [theirs])
  return {"identical": False, "compared": min(len(ours), len(theirs)),
          "lengths": [len(ours), len(theirs)], "divergence": div[0] if div else None}
