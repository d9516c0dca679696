"""`specjax generate`: plain vs speculative decoding side by side, on one set of prompts."""

from __future__ import annotations

import argparse
import json

from specjax.commands.models import (add_config_flags, add_mesh_flag, default_models,
                                     draft_from_flags, ints_arg, target_from_flags)
from specjax.resolve import HEAD_DRAFTS
from specjax.resolve import draft_kind as resolve_kind


def add_parser(subparsers) -> None:
  p = subparsers.add_parser(
      "generate", help="generate text with plain and speculative decoding and compare",
      description="Runs plain autoregressive decoding and chain speculative decoding on the "
      "same prompts and prints the text, α, τ and tokens/s of both (compiled once, timed on "
      "a second call). Models come from --target/--draft (the trained embedded default pair, "
      "a Hugging Face directory or a specjax checkpoint) or are randomly initialised from "
      "--target-config/--draft-config. --draft lookup drafts by prompt lookup (n-gram "
      "matches in the context, no model); --draft layer-skip:M drafts with the target's own "
      "first M layers.")
  p.add_argument("--target", default=None, metavar="default|DIR",
                 help="'default' (embedded trained tiny target; trained on first use), a "
                 "Hugging Face model directory or a specjax checkpoint directory")
  p.add_argument("--draft", default=None,
                 metavar="default|self|lookup|layer-skip:M|medusa:DIR|eagle:DIR|DIR",
                 help="'default' (the embedded distilled draft), 'self', 'lookup' (prompt "
                 "lookup: the continuation of the context's longest earlier suffix match, "
                 "sizes from --ngram-max/--ngram-min), 'layer-skip:M' (the target's first M "
                 "layers, final norm and head, sharing its weights), 'medusa:DIR' / "
                 "'medusa:default' (Medusa heads trained for the target by `specjax train "
                 "medusa`; the default target's are built on first use; --k is then the node "
                 "budget of the static tree built from the heads' measured acceptance), "
                 "'eagle:DIR' / 'eagle:default' (an EAGLE head, `specjax train eagle`: a chain "
                 "of --k), or a directory (write ./lookup for a directory of that name)")
  p.add_argument("--ngram-max", type=int, default=3,
                 help="--draft lookup: longest suffix tried (default %(default)s)")
  p.add_argument("--ngram-min", type=int, default=1,
                 help="--draft lookup: shortest suffix tried (default %(default)s)")
  add_config_flags(p, "as --target-config; the word 'self' uses the target as its own draft")
  p.add_argument("--prompt", action="append", default=None,
                 help="prompt text (repeat for a ragged batch; default: a code snippet)")
  p.add_argument("--chat", action="store_true",
                 help="each --prompt is a user message, rendered with the target tokenizer's "
                 "chat template (as transformers' apply_chat_template with the generation "
                 "prompt; `specjax bench` renders its prompts the same way)")
  p.add_argument("--batch", type=int, default=1, help="copies of the prompt list (default 1)")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--k", type=_k_arg, default=None,
                 help="drafted tokens per verification, or 'auto': the adaptive policy picks "
                 "a chain k in {0, 1, 2, 4, 6} every cycle (specjax.engine.adaptive.policy) (default 4; "
                 "not with --tree or --dynamic-tree, which set their own nodes)")
  p.add_argument("--tree", type=ints_arg(1), default=None, metavar="W1,W2,...",
                 help="verify a static tree instead of a chain: W_d candidates per node at "
                 "depth d (e.g. 2,1,1); drafted as distinct top candidates at T = 0")
  p.add_argument("--dynamic-tree", type=ints_arg(3), default=None, metavar="BUDGET,DEPTH,WIDTH",
                 help="verify an EAGLE-2 style dynamic tree: BUDGET nodes chosen by the "
                 "draft's cumulative confidence from DEPTH levels of WIDTH candidates")
  p.add_argument("--draft-stop", type=float, default=0.0, metavar="THRESHOLD",
                 help="with --k auto: dynamic draft stopping, a chain stops drafting once "
                 "every row's cumulative draft confidence is below THRESHOLD in [0, 1] "
                 "(0 = off, the default; the rest of the verified chain is point-mass "
                 "fillers, exact)")
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  p.add_argument("--top-k", type=int, default=0, help="0 = off")
  p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  p.add_argument("--deterministic-draft", action="store_true",
                 help="propose the draft's argmax (point masses) instead of sampling from q")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--repeats", type=int, default=3, help="timed calls after the compile call")
  p.add_argument("--allow-beyond-max-len", action="store_true",
                 help="let a RoPE model generate past max_len, the length it was trained for "
                 "(refused by default: quality past it is not guaranteed; learned position "
                 "embeddings cannot go past it at all)")
  p.add_argument("--precision", default="highest", choices=("highest", "high", "default"),
                 help="matmul precision of plain and speculative decoding alike: 'highest' "
                 "(full float32, the setting greedy identity is tested under), 'high', or "
                 "'default' (the backend's fastest, e.g. TF32 on GPUs) (default: %(default)s)")
  p.add_argument("--target-dtype", choices=("float32", "bfloat16"), default=None,
                 help="serve the target's weights in this dtype (default: bfloat16 for "
                 "--target default, as the studies serve it; else as stored)")
  p.add_argument("--json", action="store_true", help="print one JSON document")
  add_mesh_flag(p)
  p.set_defaults(func=run)


def _draft_kind(args) -> tuple[str, int | str | None]:
  """`resolve.draft_kind` of --draft, with "model" for every draft that is a model."""
  kind, arg = resolve_kind(args.draft, "--draft")
  return (kind, arg) if kind in ("lookup", "layer-skip") + HEAD_DRAFTS else ("model", None)


def _drafter(args, target, draft, serving=None):
  """(drafter, the k= or tree= of speculative_generate) for --draft (`resolve.make_drafter`),
  validated before anything compiles; `serving`: the target as served (--target-dtype)."""
  from specjax.verify import trees
  from specjax.resolve import make_drafter
  tree = _tree(args)
  # a static tree at T = 0 drafts distinct top candidates (i.i.d. siblings would all be the
  # argmax: the point-mass rule); a dynamic tree's candidates are always deterministic
  deterministic = args.deterministic_draft or (isinstance(tree, trees.TreeSpec)
                                               and args.temperature == 0)
  return make_drafter(args.draft, target, draft, k=args.k, tree=tree,
                      deterministic=deterministic, ngram=(args.ngram_max, args.ngram_min),
                      flag="--draft", serving=serving)


def _serving(args, target):
  """The target with its weights in --target-dtype (default: bfloat16 for the shipped
  default target, which the studies serve in bf16; else as stored)."""
  from specjax.models.transformer import with_dtype
  dtype = args.target_dtype or ("bfloat16" if args.target == "default" else None)
  return target if dtype is None else with_dtype(target, dtype)


def _models(args):
  """(target, draft, tokenizer) as the flags ask; validated before anything is built. The
  draft is None for the drafters without a model of their own (lookup, layer-skip)."""
  if "default" in (args.target, args.draft):
    from specjax.training.presets import DEFAULT_PRESET, get_preset
    preset = get_preset(DEFAULT_PRESET)  # sizes known before the models are trained or loaded
    _check_context(args, [preset.target, preset.draft], 1, known=False)
  pair = default_models(args.target, args.draft)
  target, tok = target_from_flags(args, pair)
  draft_spec = args.draft or ("self" if args.draft_config == "self" else None)
  if _draft_kind(args)[0] != "model":
    draft = None  # built from the target (layer-skip, heads) or no model at all (lookup)
  else:
    draft = draft_from_flags(draft_spec, args, target, pair, tokenizer=tok)
  return target, draft, tok


def _k_arg(text: str):
  """--k: an int, or 'auto' (adaptive speculation)."""
  if text == "auto":
    return text
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be an int >= 1 or 'auto', got {text!r}") from None


def _tree(args):
  """The tree --tree or --dynamic-tree asks for (None: a chain of --k)."""
  from specjax.verify import trees
  if args.tree is not None:
    return trees.branching(args.tree)
  if args.dynamic_tree is not None:
    budget, depth, width = args.dynamic_tree
    return trees.DynamicTree(budget, depth, width)
  return None


def _plan(args):
  """The speculation plan --k, --tree or --dynamic-tree asks for (`plan.of`: the host API's
  one check of a shape), built before any model; its error names the flag."""
  from specjax.engine import plan
  tree = _tree(args)
  try:
    return plan.of(k=None if tree is not None else args.k, tree=tree)
  except ValueError as e:
    raise ValueError(f"--{e}" if str(e).startswith("k ") else f"{_shape_flag(args)}: {e}"
                     ) from None


def _shape_flag(args) -> str:
  """The flag that sets the shape, as the user gave it: --k K, --tree W1,W2,... or
  --dynamic-tree BUDGET,DEPTH,WIDTH."""
  if args.tree is not None:
    return "--tree " + ",".join(map(str, args.tree))
  if args.dynamic_tree is not None:
    return "--dynamic-tree " + ",".join(map(str, args.dynamic_tree))
  return f"--k {args.k}"


def _k_max(args) -> int:
  """The most drafts one cycle may verify: --k, a tree's nodes, or the adaptive menu's
  largest chain."""
  spec = _plan(args)
  if spec.auto:
    from specjax.engine.adaptive import policy as adaptive
    return max(adaptive.DEFAULT_CHAINS)
  return spec.k


def _check_args(args) -> None:
  """The flags that need no model, checked before any model is loaded or built."""
  for flag, value, lo in (("--batch", args.batch, 1), ("--repeats", args.repeats, 1),
                          ("--max-new-tokens", args.max_new_tokens, 1), ("--seed", args.seed, 0)):
    if value < lo:
      raise ValueError(f"{flag} must be an int >= {lo}, got {value}")
  if args.tree is not None and args.dynamic_tree is not None:
    raise ValueError("--tree and --dynamic-tree are two shapes: give one")
  if (args.tree is not None or args.dynamic_tree is not None) and args.k == "auto":
    raise ValueError("--k auto chooses chains each cycle: leave it out with --tree or "
                     "--dynamic-tree")
  if (args.tree is not None or args.dynamic_tree is not None) and args.k is not None:
    raise ValueError(f"--k {args.k} with {_shape_flag(args)}: a tree sets its own nodes "
                     f"(the drafts one cycle verifies), so --k would be ignored; give one")
  if args.k is None:
    args.k = 4  # the default chain
  _plan(args)  # --k / the tree, checked once by the library
  if args.draft_stop != 0.0:
    from specjax.engine.adaptive import policy as adaptive
    if args.k != "auto":
      raise ValueError(f"--draft-stop {args.draft_stop} needs --k auto (draft stopping is "
                       f"part of the adaptive loop), got --k {args.k}")
    try:
      adaptive.check_threshold(args.draft_stop)
    except ValueError as e:
      raise ValueError(f"--draft-stop: {e}") from None
  kind, _ = _draft_kind(args)
  if args.draft_stop != 0.0 and kind in ("lookup", "medusa"):
    raise ValueError(f"--draft-stop {args.draft_stop}: the {kind} drafter has no draft "
                     f"confidence to stop on (it proposes fixed candidates); use a model, "
                     f"layer-skip or EAGLE draft, or leave --draft-stop at 0")
  if kind == "lookup":
    from specjax.drafters.lookup import check_ngram
    try:
      check_ngram(args.ngram_max, args.ngram_min)
    except ValueError as e:
      raise ValueError(f"--ngram-max {args.ngram_max} / --ngram-min {args.ngram_min}: "
                       f"{e}") from None
  if kind in HEAD_DRAFTS and args.draft.endswith(":default") and args.target != "default":
    raise ValueError(f"--draft {args.draft} holds heads for the default target: pass "
                     f"--target default, or {kind}:DIR with heads trained for --target")
  for i, text in enumerate(args.prompt or []):
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as surrogates
      raise ValueError(f"--prompt #{i + 1} is not valid UTF-8 (character {e.start} of "
                       f"{len(text)}): pass the prompt as UTF-8 text") from None


def _check_context(args, configs, n_prompt_tokens: int, known: bool = True) -> None:
  """The longest prompt + --max-new-tokens + --k + 1 against the models' max_len, before the
  chain of --k drafts is built or anything compiles: a clear message naming the flags.
  known=False: the prompt is not tokenized yet and n_prompt_tokens is a lower bound."""
  from specjax.engine.batching import context_limits  # the library's context rule
  max_len, limited, lift = context_limits(configs, args.allow_beyond_max_len)
  need = n_prompt_tokens + args.max_new_tokens + _k_max(args) + 1
  if limited and need > max_len:
    opt_in = "" if not lift else (
        ", or pass --allow-beyond-max-len to let a RoPE model run past the length it was "
        "trained for")
    raise ValueError(
        f"{'the longest prompt (' if known else 'a prompt (at least '}{n_prompt_tokens} "
        f"tokens) + --max-new-tokens {args.max_new_tokens} + {_slots_text(args)} + 1 = "
        f"{need} positions exceeds the models' max_len {max_len}: shorten the prompt or "
        f"lower --max-new-tokens or {_shape_flag(args).split()[0]}{opt_in}")


def _slots_text(args) -> str:
  """The drafts one cycle verifies, named by the flag that sets them."""
  if args.tree is None and args.dynamic_tree is None:
    return f"--k {args.k}"
  return f"{_shape_flag(args)} ({_k_max(args)} nodes)"


DEFAULT_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def _encode(args, tok, text: str) -> list[int]:
  """One prompt's ids: with --chat, the user message rendered by the tokenizer's chat
  template (`chat.encode_messages`; refused in one line without a template); else the text
  after a BOS."""
  if not args.chat:
    return tok.encode(text, bos=True)
  from specjax.data import chat
  if chat.template_of(tok) is None:
    target = (f"--target {args.target}" if args.target is not None
              else f"a random target from --target-config {args.target_config} (byte "
              f"tokenizer)")
    raise ValueError(f"--chat: the target's tokenizer has no chat template (chat_template in "
                     f"tokenizer_config.json, or chat_template.jinja), {target}; "
                     f"leave out --chat to encode the prompt as plain text")
  return chat.encode_messages(tok, [{"role": "user", "content": text}])


def _stop_ids(tok):
  """Every EOS id the target's files list (`chat.stop_ids`: generation_config.json's
  eos_token_id, an int or a list, else config.json's, and the tokenizer's eos); None
  without any."""
  from specjax.data import chat
  return list(chat.stop_ids(tok)) or None


def run(args: argparse.Namespace) -> int:
  import jax
  import numpy as np

  from specjax.engine import decoding, plan
  from specjax.verify import sampling
  from specjax.calibration import timing

  _check_args(args)
  sampler = sampling.make_sampler(args.temperature, args.top_k, args.top_p)
  stored, draft, tok = _models(args)
  target = _serving(args, stored)
  draft = target if draft is stored else draft  # "self" drafts with the served weights
  target_cfg = target.config
  texts = (args.prompt or [DEFAULT_PROMPT]) * args.batch
  prompts = [_encode(args, tok, t) for t in texts]
  drafter, shape = _drafter(args, stored, draft, serving=target)
  if args.draft_stop > 0:  # --k auto (checked): the default policy with draft stopping
    shape = {"policy": decoding.default_policy(target, drafter, threshold=args.draft_stop)}
  shape = {"plan": plan.of(**shape)}  # the drafter's shape (Medusa: its best tree), built once
  draft_configs = [] if drafter.config is None else [drafter.config]
  _check_context(args, [target.config] + draft_configs, max(len(p) for p in prompts))
  common = dict(max_new_tokens=args.max_new_tokens, sampler=sampler, seed=args.seed,
                eos_id=_stop_ids(tok), allow_beyond_max_len=args.allow_beyond_max_len,
                precision=args.precision)

  def timed(fn):
    fn()  # compile
    runs = [fn() for _ in range(args.repeats)]
    return runs[-1], float(np.median([r.seconds for r in runs]))

  def call(n):  # both with max_new_tokens n (1: the prefill alone, for the decode phase)
    few = {**common, "max_new_tokens": n}
    return (timed(lambda: decoding.generate(target, prompts, **few)),
            timed(lambda: decoding.speculative_generate(target, drafter, prompts, **shape,
                                                        **few)))

  (plain, plain_s), (spec, spec_s) = call(args.max_new_tokens)
  (_, plain_1), (_, spec_1) = call(1)
  summary = spec.summary()
  decoded = plain.emitted - len(plain.tokens)  # after each row's first token
  report = {
      "backend": jax.default_backend(),
      "target_config": target_cfg.to_dict(),
      "drafter": args.draft or ("self" if args.draft_config == "self" else "model"),
      "k": args.k, "shape": _shape_name(args), "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
      "batch": len(prompts),
      "plain": {"tokens": plain.emitted, "seconds": plain_s,
                "tokens_per_s": plain.emitted / plain_s},
      "speculative": {"tokens": spec.emitted, "seconds": spec_s,
                      "tokens_per_s": spec.emitted / spec_s, **summary.to_dict()},
      "target_dtype": target.config.dtype, "chat": args.chat, "eos_ids": common["eos_id"],
      "speedup": (spec.emitted / spec_s) / (plain.emitted / plain_s),
      "decode_phase": timing.decode_phase(decoded, spec.emitted - len(spec.tokens),
                                    plain_s - plain_1, spec_s - spec_1),
      "identical_to_plain": plain.tokens == spec.tokens,
      "acceptance_by_depth": _by_depth(spec.stats),
      "texts": [tok.decode(t) for t in spec.tokens],
  }
  if spec.choices is not None:  # --k auto: the shape chosen at each loop iteration
    report["choices"] = [spec.menu[i] for i in spec.choices]
    report["draft_stop"] = {"threshold": args.draft_stop,
                            "stopped_cycles": int(spec.stopping["stopped"].sum()),
                            "skipped_nodes": int(spec.stopping["skipped"].sum())}
  if args.json:
    print(json.dumps(report, indent=2))
    return 0
  for i, text in enumerate(report["texts"]):
    print(f"--- row {i}: {texts[i]!r} ->\n{text}")
  print()
  print("\n".join(summary_lines(report, args.temperature)))
  return 0


def _shape_name(args) -> str:
  if args.tree is not None:
    return "tree " + ",".join(map(str, args.tree))
  if args.dynamic_tree is not None:
    return "dynamic tree {},{},{}".format(*args.dynamic_tree)
  return f"k={args.k}"


def _by_depth(stats) -> list:
  """Per draft depth: accepted ÷ tried, over all rows (None where nothing was tried)."""
  if stats is None or "depth_tried" not in stats:
    return []
  tried, accepted = stats["depth_tried"].sum(axis=0), stats["depth_accepted"].sum(axis=0)
  return [float(a / t) if t else None for a, t in zip(accepted, tried)]


def summary_lines(report: dict, temperature: float) -> list[str]:
  """The text summary of a `run` report: tokens/s of both, speedup, α with its interval,
  τ. A run that drafted nothing (--k auto choosing k = 0 every cycle) has no α: printed as
  "n/a (no drafts)", as a run without verifications has no τ."""
  s = report["speculative"]
  if s.get("alpha") is None:
    alpha = "α = n/a (no drafts)"
  else:
    low, high = s["alpha_ci"]
    alpha = f"α = {s['alpha']:.3f} [{low:.3f}, {high:.3f}]"
  tau = ("τ = n/a (no verifications)" if s.get("tau") is None
         else f"τ = {s['tau']:.2f} tokens/verification")
  lines = [f"plain:        {report['plain']['tokens_per_s']:8.1f} tok/s end to end",
           f"speculative:  {s['tokens_per_s']:8.1f} tok/s end to end   "
           f"({report.get('shape', 'k=' + str(report['k']))}, "
           f"speedup {report['speedup']:.2f}x)"]
  if report.get("decode_phase") is None and "decode_phase" in report:
    lines.append("decode phase: lost in timing noise (use more --max-new-tokens or --repeats)")
  elif "decode_phase" in report:
    d = report["decode_phase"]
    lines.append(f"decode phase: {d['plain_tokens_per_s']:.1f} -> "
                 f"{d['speculative_tokens_per_s']:.1f} tok/s (speedup {d['speedup']:.2f}x; "
                 f"prefill subtracted), target weights in {report.get('target_dtype')}")
  lines.append(f"{alpha}   {tau}")
  if report.get("acceptance_by_depth"):
    lines.append("acceptance by draft depth: " + " ".join(
        "-" if a is None else f"{a:.2f}" for a in report["acceptance_by_depth"]))
  if temperature == 0:
    lines.append(f"greedy outputs identical to plain decoding: {report['identical_to_plain']}")
  return lines
