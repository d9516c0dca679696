"""Spec-Bench: every question of a prompt set decoded plainly and speculatively, side by side.

One point = one question (`question` = its `question_id`; the sweep's axis is the set's ids:
the embedded sets' 0..15, a file's own; `specjax bench` fills it in, and a config that leaves
it out gets every id of its `prompts`, `default_axes`). Models and drafters by reference (`specjax.resolve`: any
target, any drafter kind), prompts by reference (`specjax.data.prompts`: a Spec-Bench / MT-Bench
question file, a plain JSONL file, or the embedded `code` / `prose` sets), rendered with the
target tokenizer's chat template when it has one (`chat_template=False` opts out). The first
turn of each question is decoded (Spec-Bench's single-turn setting); with `multi_turn`
(`specjax bench --multi-turn`) every turn is, in order, each turn's conversation holding the
earlier turns and the model's own answers to them (the plain run's output, the target's law)
as the assistant turns: one row per question, counts and seconds summed and τ, α pooled over
its turns (`turns`, `turn_prompt_tokens`). Decoding stops on every
EOS id the target's files list (`eos_ids` in the rows).

Each question is decoded `batch` rows at a time (copies of it; batch 1 is Spec-Bench's
setting) with plain `generate` and with `speculative_generate` of the shape (`k`, a chain;
`tree_widths`, a static tree), alternated `repeats` times after a warm-up call, both stopping
at every EOS id of the target. Two speeds, labelled:

    speedup       end to end: plain ÷ speculative wall time of the same call, prefill
                  included (Spec-Bench's measure)
    speedup_decode  the decode phase: each also timed with max_new_tokens = 1, that prefill
                  subtracted

Row fields: question_id, category, prompt_tokens, new_tokens, tau (mean accepted tokens per
verification, Spec-Bench's "mean accepted tokens"), alpha, plain_tok_s, spec_tok_s, speedup,
speedup_decode (None with `speedup_decode_note` when the decode phase is lost in timing
noise), accept_by_position (accepted ÷ tried per draft depth), loop_fraction, and at
T = 0 identical_to_plain (where not, `divergences` and `only_ties`: `measure.divergences`). The report: Spec-Bench's table per category and overall (mean
accepted tokens, speedup, tokens/s) and acceptance by draft position.
"""

from __future__ import annotations

import functools
import math
import pathlib
import statistics

import numpy as np

from specjax.experiments import measure
from specjax.engine import decoding
from specjax.analysis import metrics
from specjax import resolve
from specjax.verify import sampling, trees
from specjax.calibration import timing
from specjax.data.prompts import encode_prompt, load_prompts
from specjax.data import chat
from specjax.sweeps.report import cell
from specjax.engine import plan
from specjax import sharding
from specjax.sweeps.runner import with_defaults

EMBEDDED_COUNT, EMBEDDED_LEN = 16, 64  # the embedded sets' questions and their length


def validate(params: dict) -> None:
  """The values of a point, checked without loading a model (`specjax run` checks every
  point with it before any work; `preflight` loads the models once and checks the rest)."""
  for name in ("max_new_tokens", "batch", "repeats"):
    value = params.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 1):
      raise ValueError(f"{name} must be an int >= 1, got {value!r}")
  k = params.get("k")
  if params.get("tree_widths") is None and k != "auto" and (
      not isinstance(k, int) or isinstance(k, bool) or k < 1):
    raise ValueError(f"k must be an int >= 1 or 'auto', got {k!r}")
  widths = params.get("tree_widths")
  if widths is not None:
    try:
      trees.branching(widths)
    except ValueError as e:
      raise ValueError(f"tree_widths must be a list of ints >= 1 (candidates per depth, e.g. "
                       f"(2, 1)) or None, got {widths!r}: {e}") from None
  sampling.make_sampler(params.get("temperature", 0.0), params.get("top_k", 0),
                        params.get("top_p", 1.0))  # the sampler's own checks
  for name in ("multi_turn", "chat_template", "allow_beyond_max_len"):
    if not isinstance(params.get(name, False), bool):
      raise ValueError(f"{name} must be True or False, got {params[name]!r}")
  dtype = params.get("target_dtype")
  if dtype not in DTYPES:
    raise ValueError(f"target_dtype must be one of {DTYPES} (None: as stored), got {dtype!r}")
  if "question" in params and "prompts" in params:
    ids = question_ids(params["prompts"])
    if params["question"] not in ids:
      shown = ", ".join(map(repr, ids[:5])) + (", ..." if len(ids) > 5 else "")
      raise ValueError(f"question {params['question']!r} is not a question id of prompts "
                       f"{params['prompts']!r} (its ids: {shown}); leave the question axis "
                       f"out to decode them all, or `specjax bench --prompts "
                       f"{params['prompts']}`")


DTYPES = (None, "float32", "bfloat16")


def default_axes(fixed: dict) -> dict:
  """The axis a config may leave out: every question id of the prompt set (`prompts`), in
  file order, so `specjax run specbench --set prompts=FILE` decodes the file's questions."""
  return {"question": question_ids(fixed.get("prompts", "code"))}


def preflight(params: dict, mesh=None) -> None:
  """What `specjax bench` checks once before any question, after `validate`: the models
  load (target, draft, its tokenizer, tree, dtype), the mesh fits the devices and the
  models, and a one-token prompt fits the context with `max_new_tokens` and the shape.
  ValueError naming the value, as `specjax generate` reports it."""
  params = with_defaults(point, params)
  key = _key(params)
  run = loaded(*key)
  chat.template_of(run.tokenizer, use_chat_template=params["chat_template"])
  mesh = sharding.check_mesh(mesh)
  if mesh is not None:
    sharding.check_heads(run.target.config, mesh)
    if run.draft is not None and run.draft is not run.target:
      sharding.check_heads(run.draft.config, mesh, "draft")
  with sharding.on(mesh):
    try:
      plan.prepare(run.target, run.drafter, [[0]] * params["batch"], plan.of(**run.shape),
                   max_new_tokens=params["max_new_tokens"],
                   sampler=sampling.make_sampler(params["temperature"], params["top_k"],
                                                 params["top_p"]),
                   allow_beyond_max_len=params["allow_beyond_max_len"],
                   row_multiple=sharding.data_size(mesh))
    except ValueError as e:
      raise ValueError(f"max_new_tokens {params['max_new_tokens']} with the shape "
                       f"({_shape_name(params)}) does not fit even a one-token question: "
                       f"{e}") from None


def _shape_name(params: dict) -> str:
  w = params.get("tree_widths")
  return f"k {params.get('k')}" if w is None else "tree " + ",".join(map(str, w))


def _key(params: dict) -> tuple:
  """The arguments of `loaded` (and, with multi_turn, of `prompt_set`) of a point."""
  w = params["tree_widths"]
  return (params["target"], params["draft"], params["k"], None if w is None else tuple(w),
          params["temperature"], params["target_dtype"])


def memory(params: dict) -> int:
  return 0  # the models' own checks (`kv.check_fits`) run when a question is decoded


@functools.lru_cache(maxsize=2)
def loaded(target: str, draft: str, k, tree_widths, temperature: float, target_dtype):
  """The resolved models (`specjax.load`), once per process for every question. A tree at
  T = 0 drafts distinct top-k candidates (the point-mass rule), otherwise samples of q."""
  tree = None if tree_widths is None else trees.branching(tuple(tree_widths))
  return resolve.load(target, draft, k=k, tree=tree, target_dtype=target_dtype,
                      deterministic=tree is not None and temperature == 0)


@functools.lru_cache(maxsize=4)
def prompt_set(ref: str, target: str, draft: str, k, tree_widths, temperature, target_dtype,
               multi_turn: bool = False):
  """{question_id: Prompt} of `ref` (the embedded sets cut with the target's tokenizer;
  a file's questions with every turn when `multi_turn`)."""
  tok = loaded(target, draft, k, tree_widths, temperature, target_dtype).tokenizer
  prompts = load_prompts(ref, tokenizer=tok, count=EMBEDDED_COUNT, prompt_len=EMBEDDED_LEN) \
      if ref in ("code", "prose") else load_prompts(ref, multi_turn=multi_turn)
  return {p.question_id: p for p in prompts}


def question_ids(ref: str) -> list:
  """The question ids of a prompt set, in file order (the sweep's axis): the embedded
  sets' 0..EMBEDDED_COUNT-1 (`prompts.embedded_prompts`), a file's own ids."""
  if ref in ("code", "prose"):
    return list(range(EMBEDDED_COUNT))
  path = pathlib.Path(ref)
  try:
    st = path.stat()
  except OSError:
    return [p.question_id for p in load_prompts(ref)]  # load_prompts says what is wrong
  return list(_file_ids(str(path), st.st_ino, st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _file_ids(path: str, inode: int, size: int, mtime_ns: int) -> tuple:
  """A prompt file's ids, read once per version of the file (`validate` asks per point)."""
  return tuple(p.question_id for p in load_prompts(path))


def point(question, target: str = "default", draft: str = "eagle:default",
          prompts: str = "code", k=4, tree_widths=None, temperature: float = 0.0,
          top_k: int = 0, top_p: float = 1.0, max_new_tokens: int = 128, batch: int = 1,
          repeats: int = 3, seed: int = 0, chat_template: bool = True,
          target_dtype: str | None = None, multi_turn: bool = False,
          allow_beyond_max_len: bool = False) -> dict:
  key = _key(dict(target=target, draft=draft, k=k, tree_widths=tree_widths,
                  temperature=temperature, target_dtype=target_dtype))
  run = loaded(*key)
  questions = prompt_set(prompts, *key, multi_turn)
  if question not in questions:
    raise ValueError(f"question {question!r} is not in {prompts}")
  prompt = questions[question]
  eos = _eos_ids(run.tokenizer)
  common = dict(sampler=sampling.make_sampler(temperature, top_k, top_p), seed=seed,
                eos_id=eos, allow_beyond_max_len=allow_beyond_max_len)
  turns, answers = [], []
  for turn in range(prompt.n_turns):  # one unless multi_turn read every turn
    ids = encode_prompt(prompt, run.tokenizer, turn=turn, answers=answers,
                        use_chat_template=chat_template)
    turns.append(_decode_turn(run, [ids] * batch, common, max_new_tokens, repeats,
                              temperature))
    # the model's own answer (the plain run's: the target's law) becomes the assistant turn
    answers.append(run.tokenizer.decode(turns[-1]["plain"].tokens[0]))
  return {**prompt.row(), **_row(turns, temperature), "eos_ids": eos,
          **({"turns": len(turns)} if multi_turn else {})}


def _decode_turn(run, rows, common, max_new_tokens: int, repeats: int, temperature) -> dict:
  """One turn decoded plainly and speculatively, alternated (module doc): both Generations,
  the median seconds of each call, and at T = 0 where they differ."""
  def plain(n):
    return lambda: decoding.generate(run.target, rows, max_new_tokens=n, **common)

  def spec(n):
    return lambda: decoding.speculative_generate(run.target, run.drafter, rows,
                                                 max_new_tokens=n, **run.shape, **common)

  timed = measure.alternate({"plain": plain(max_new_tokens), "spec": spec(max_new_tokens),
                             "plain_prefill": plain(1), "spec_prefill": spec(1)}, repeats)
  out = {"seconds": {name: t.median for name, t in timed.items()}, "rows": rows,
         "plain": timed["plain"].result, "spec": timed["spec"].result}
  out["same"] = out["plain"].tokens == out["spec"].tokens
  if temperature == 0 and not out["same"]:  # a numerical tie broken the other way, or a bug?
    out["divergences"] = measure.divergences(run.target, rows, out["plain"].tokens,
                                             out["spec"].tokens)
  return out


def _row(turns: list[dict], temperature) -> dict:
  """The result fields of a question over its decoded turns (one unless multi-turn):
  counts, seconds, acceptance and accepted tokens pooled over the turns."""
  total = {name: sum(t["seconds"][name] for t in turns) for name in turns[0]["seconds"]}
  plain = [t["plain"] for t in turns]
  spec = [t["spec"] for t in turns]
  summaries = [g.summary() for g in spec]
  cycles = sum(m.cycles for m in summaries)
  drafted = sum(m.drafted for m in summaries)
  decode = timing.decode_phase(sum(g.emitted - len(g.tokens) for g in plain),
                               sum(g.emitted - len(g.tokens) for g in spec),
                               total["plain"] - total["plain_prefill"],
                               total["spec"] - total["spec_prefill"])
  depth = max(g.stats["depth_tried"].shape[1] for g in spec)
  tried, accepted = np.zeros(depth), np.zeros(depth)
  for g in spec:
    d = g.stats["depth_tried"].shape[1]
    tried[:d] += g.stats["depth_tried"].sum(axis=0)
    accepted[:d] += g.stats["depth_accepted"].sum(axis=0)
  same = all(t["same"] for t in turns)
  div = [{**d, "turn": i} for i, t in enumerate(turns) for d in t.get("divergences", [])]
  extra = {} if not div else {
      "divergences": div, "only_ties": all(d["ulps"] is not None and d["ulps"] <= 2
                                           for d in div)}
  out = {
      "prompt_tokens": len(turns[0]["rows"][0]),
      "new_tokens": int(sum(np.mean([len(r) for r in g.tokens]) for g in spec)),
      "tau": sum(m.emitted for m in summaries) / cycles if cycles else None,
      "alpha": sum(m.accepted for m in summaries) / drafted if drafted else None,
      "plain_tok_s": sum(g.emitted for g in plain) / total["plain"],
      "spec_tok_s": sum(g.emitted for g in spec) / total["spec"],
      "speedup": total["plain"] / total["spec"],
      "speedup_decode": decode["speedup"] if decode else None, **({} if decode else {
          "speedup_decode_note": NO_DECODE_PHASE}),
      "plain_s": total["plain"], "spec_s": total["spec"],
      "accept_by_position": [float(a / t) if t else None for a, t in zip(accepted, tried)],
      "loop_fraction": metrics.loop_fraction([r for g in spec for r in g.tokens]),
      "identical_to_plain": same if temperature == 0 else None, **extra,
  }
  if len(turns) > 1:
    out["turn_prompt_tokens"] = [len(t["rows"][0]) for t in turns]
  return out


NO_DECODE_PHASE = ("decode phase lost in timing noise (the call of max_new_tokens was not "
                   "slower than the one-token call): raise max_new_tokens or repeats")
NO_TAU = ("no speculative cycle ran (--k auto chose plain steps throughout), so no tokens "
          "were accepted per verification")


def _eos_ids(tokenizer):
  """The EOS ids decoding stops on: every id the model's files list (`chat.stop_ids`:
  generation_config.json's eos_token_id, an int or a list, else config.json's, and the
  tokenizer's eos), None without any."""
  ids = chat.stop_ids(tokenizer)
  return list(ids) if ids else None


def table(records: list[dict]) -> list[dict]:
  """Spec-Bench's table: per category and overall, the questions, mean accepted tokens (τ),
  the speedup (total plain ÷ total speculative seconds: the ratio of the summed walls, as a
  workload sees it) beside the mean per-question speedup, and tokens/s of both."""
  groups: dict[str, list[dict]] = {}
  for r in records:
    groups.setdefault(r["metrics"]["category"], []).append(r["metrics"])
  out = []
  for name, ms in sorted(groups.items()) + [("overall", [m for g in groups.values()
                                                         for m in g])]:
    plain_s, spec_s = sum(m["plain_s"] for m in ms), sum(m["spec_s"] for m in ms)
    out.append({"category": name, "questions": len(ms),
                "tau": statistics.mean(m["tau"] for m in ms if m["tau"] is not None)
                if any(m["tau"] is not None for m in ms) else None,
                "speedup": plain_s / spec_s,
                "mean_speedup": statistics.mean(m["speedup"] for m in ms),
                "plain_tok_s": sum(m["plain_tok_s"] * m["plain_s"] for m in ms) / plain_s,
                "spec_tok_s": sum(m["spec_tok_s"] * m["spec_s"] for m in ms) / spec_s,
                "identical": (sum(bool(m["identical_to_plain"]) for m in ms)
                              if ms[0]["identical_to_plain"] is not None else None),
                "ties": sum(bool(m.get("only_ties")) for m in ms)})
  return out


def report(records: list[dict], run_dir) -> str:
  ok = [r for r in records if "metrics" in r and r["metrics"]]
  if not ok:
    return "## Spec-Bench\n\nNo question finished."
  params = ok[0]["params"]
  lines = ["## Spec-Bench", "",
           f"Target `{params.get('target')}`, draft `{params.get('draft')}`, prompts "
           f"`{params.get('prompts')}`, T = {params.get('temperature', 0.0):g}, batch "
           f"{params.get('batch', 1)}, {params.get('max_new_tokens')} new tokens at most. "
           "Speedup = plain ÷ speculative wall time end to end (prefill included; the ratio "
           "of summed times, mean per question beside); τ = mean accepted tokens per "
           "verification.", "",
           "| category | questions | mean accepted tokens (τ) | speedup | mean speedup | "
           "plain tok/s | spec tok/s | identical at T=0 |",
           "|---|---|---|---|---|---|---|---|"]
  rows = table(ok)
  for row in rows:
    same = "-" if row["identical"] is None else f"{row['identical']}/{row['questions']}"
    same += f" ({row['ties']} at ties)" if row.get("ties") else ""
    tau = "n/a" if row["tau"] is None else f"{row['tau']:.2f}"
    lines.append(f"| {cell(row['category'])} | {row['questions']} | {tau} | "
                 f"{row['speedup']:.2f}× | {row['mean_speedup']:.2f}× | "
                 f"{row['plain_tok_s']:.1f} | {row['spec_tok_s']:.1f} | {same} |")
  depth = max(len(r["metrics"]["accept_by_position"]) for r in ok)
  by_pos = []
  for d in range(depth):
    vals = [r["metrics"]["accept_by_position"][d] for r in ok
            if d < len(r["metrics"]["accept_by_position"])
            and r["metrics"]["accept_by_position"][d] is not None]
    by_pos.append(f"{statistics.mean(vals):.3f}" if vals else "-")
  decode = [r["metrics"]["speedup_decode"] for r in ok
            if r["metrics"].get("speedup_decode") is not None
            and not math.isnan(r["metrics"]["speedup_decode"])]
  lost = len(ok) - len(decode)
  if any(r["tau"] is None for r in rows):
    lines += ["", f"τ n/a: {NO_TAU}."]
  lines += ["", "Acceptance by draft position (accepted ÷ tried, mean over questions): "
            + " ".join(by_pos),
            "", f"Decode-phase speedup (prefill subtracted), mean over questions: "
            + (f"{statistics.mean(decode):.2f}×" if decode else "n/a")
            + (f" ({lost} of {len(ok)} questions without one: {NO_DECODE_PHASE})"
               if lost else ""),
            f"Loop fraction (tokens continuing a repeated n-gram, period <= 8), mean: "
            f"{statistics.mean(r['metrics']['loop_fraction'] for r in ok):.3f}"]
  return "\n".join(lines)
