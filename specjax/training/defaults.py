"""The embedded default models: a trained target and a draft distilled from it (and draft
heads for the target), shipped with the package or built on first use and cached.

    pair = load_default_pair()            # the "shipped" preset on its "code+tests" corpus
    target_cfg, target_params, draft_cfg, draft_params, tokenizer = pair
    target = from_params(target_cfg, target_params)   # specjax.models.transformer
    target_cfg, target_params, tokenizer = load_default_target()   # the target alone

The params are `nnx.State`s of nnx.Param (float32; cast to the config dtype otherwise), the form
the rest of specjax passes across jit boundaries; `pair.target_module()` / `pair.draft_module()`
merge them into Transformer modules.

Shipped first: the default preset's pair is committed under specjax/embedded/
(`training.shipped`): when its recorded recipes equal the ones this code computes, it is
loaded (digests checked) and nothing is trained; otherwise (another preset, a changed recipe,
`rebuild=True`) the cache below is used and built from the recipe.

What is built is what is used: `load_default_target` trains (or loads) the target and its
tokenizer only; the distilled draft is a second entry, trained from that target the first
time a pair is asked for (`load_default_pair`). The quickstart drafts with the target's
EAGLE head, so its first run never trains the draft model.

Cache: $SPECJAX_CACHE_DIR (default ~/.cache/specjax) / models / <preset>-<corpus>-<key> (the
target and its tokenizer; <key> hashes the model and training configs, the tokenizer and the
cache format, so changing a preset never loads a stale model) and
<preset>-<corpus>-draft-<key> (the draft; <key> hashes its configs, the target's entry and
its parameter fingerprint). A build happens in <entry>.partial (holding a file lock, so
concurrent first uses train once; a process that waits for it prints one line naming the
entry and the holder's pid), resumes there if a previous build was killed, is verified, and
is renamed into place atomically. A partial that cannot be resumed (a truncated
tokenizer.json or checkpoint step, a stale build) is discarded, saying why, and built from
scratch. Its files are written all or nothing (`checkpoints.dirs.atomic_write`). The entry's
manifest.json records the recipe, the corpus fingerprint, the figures measured at build time
and a sha256 of every file; a load re-checks all of it (plus the parameter fingerprint), and
an entry that fails is reported, moved aside and rebuilt, never used. What cannot be mended
(an entry that cannot be moved aside, a fresh build that does not verify) is one line
(`CacheEntryError`) naming the directory and what to do.

Default draft heads (`load_default_heads("medusa")`, one `DEFAULT_HEADS` entry per kind) are
trained for the default target on first use (the EAGLE head by the quickstart's first run,
which drafts with it; Medusa by `--draft medusa:default` or the drafters experiment) and
cached the same way under <cache>/heads/<preset>-<corpus>-<kind>-<key>, the key hashing the
kind's spec, its schedule, the target's entry and its parameter fingerprint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import pathlib
import platform
import shutil
import sys
import time
from typing import Callable, NamedTuple

from flax import nnx

from specjax.data.batches import TokenData
from specjax.data.corpus import EMBEDDED, load_corpus
from specjax.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer
from specjax.files import atomic_write, file_sha256
from specjax.checkpoints.trained import load_trained
from specjax.models.transformer import ModelConfig, Transformer, from_params
from specjax.training.config import TrainConfig
from specjax.training.presets import DEFAULT_PRESET, get_preset
from specjax.training import shipped
from specjax.training.trainer import Teacher, params_fingerprint, train
from specjax.drafters.eagle import head_config
from specjax.training.heads import load_head
from specjax.files import cache_dir  # noqa: F401 (re-exported: the cache root)
from specjax.training.heads import HeadTrainer, TargetBinding, kind_from_spec

CACHE_FORMAT = 2  # 2: the target and the draft are separate entries
MANIFEST = "manifest.json"


class DefaultTarget(NamedTuple):
  target_config: ModelConfig
  target_params: nnx.State
  tokenizer: Tokenizer

  def target_module(self) -> Transformer:
    return from_params(self.target_config, self.target_params)


class DefaultPair(NamedTuple):
  target_config: ModelConfig
  target_params: nnx.State
  draft_config: ModelConfig
  draft_params: nnx.State
  tokenizer: Tokenizer

  def target_module(self) -> Transformer:
    return from_params(self.target_config, self.target_params)

  def draft_module(self) -> Transformer:
    return from_params(self.draft_config, self.draft_params)


def _log(msg: str) -> None:
  print(f"specjax: {msg}", file=sys.stderr, flush=True)


def _recipe(preset_name: str, corpus: str) -> dict:
  """The target entry's recipe: what its key hashes and its manifest must match."""
  preset = get_preset(preset_name)
  return {"format": CACHE_FORMAT, "preset": preset_name, "corpus": corpus,
          "tokenizer": (ByteTokenizer().to_spec() if preset.tokenizer == "byte"
                        else {"recipe": preset.tokenizer, "trained_on": "train split"}),
          "target": preset.target.to_dict(),
          "target_train": dataclasses.asdict(preset.target_train)}


def _key(recipe: dict) -> str:
  """A cache entry's key: 12 hex digits of the sha256 of its recipe."""
  return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def entry_dir(preset: str = DEFAULT_PRESET, corpus: str | None = None) -> pathlib.Path:
  """Where the default target (and its tokenizer) for (preset, corpus) lives in the cache."""
  corpus = corpus_of(preset, corpus)
  return cache_dir() / "models" / f"{preset}-{corpus}-{_key(_recipe(preset, corpus))}"


def _draft_recipe(preset_name: str, corpus: str, target_fingerprint: str) -> dict:
  """The draft entry's recipe: its configs, bound to the target it is distilled from."""
  preset = get_preset(preset_name)
  return {"format": CACHE_FORMAT, "preset": preset_name, "corpus": corpus,
          "draft": preset.draft.to_dict(), "draft_train": dataclasses.asdict(preset.draft_train),
          "target_entry": entry_dir(preset_name, corpus).name,
          "target_fingerprint": target_fingerprint}


def draft_entry_dir(preset: str, corpus: str, target_fingerprint: str) -> pathlib.Path:
  """Where the draft distilled from the default target (of that fingerprint) lives."""
  recipe = _draft_recipe(preset, corpus, target_fingerprint)
  return cache_dir() / "models" / f"{preset}-{corpus}-draft-{_key(recipe)}"


def _file_digests(root: pathlib.Path) -> dict[str, str]:
  digests = {}
  for path in sorted(root.rglob("*")):
    if path.is_file() and path.name != MANIFEST:
      digests[path.relative_to(root).as_posix()] = file_sha256(path)
  return digests


class CacheError(Exception):
  """A cache entry that is missing, partial or corrupt (the message says which). Caught
  inside this module (the entry is rebuilt); what cannot be mended reaches the caller as
  `CacheEntryError`."""


class CacheEntryError(ValueError):
  """A cache entry (or its `.partial` build) that cannot be used or mended here: one line
  naming the directory and what to do (a ValueError, so the CLI prints it without a
  traceback)."""


def _shipped(load, *args):
  """A shipped entry's loader, its damage reported as a CacheEntryError (one line)."""
  try:
    return load(*args)
  except shipped.ShippedError as e:
    raise CacheEntryError(str(e)) from None


def _one_line(e: BaseException) -> str:
  """`e` as one short line (TensorStore and orbax errors span many)."""
  text = " ".join(str(e).split()) or type(e).__name__
  return text if len(text) <= 300 else text[:297] + "..."


def _check_manifest(entry: pathlib.Path, recipe: dict, what: str) -> dict:
  """The manifest of `entry`; CacheError unless it is readable, of this recipe, and its file
  digests match the files (`what` names the recipe's source in the message)."""
  manifest_path = entry / MANIFEST
  if not manifest_path.is_file():
    raise CacheError("no manifest (partial entry)")
  try:
    manifest = json.loads(manifest_path.read_bytes().decode("utf-8"))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CacheError(f"unreadable manifest: {_one_line(e)}") from e
  if not isinstance(manifest, dict):
    raise CacheError("unreadable manifest: not a JSON object")
  if manifest.get("recipe") != recipe:
    raise CacheError(f"manifest recipe differs from the current {what}")
  try:
    digests = _file_digests(entry)
  except OSError as e:
    raise CacheError(f"cannot read its files: {_one_line(e)}") from e
  if digests != manifest.get("files"):
    expected = manifest.get("files")
    expected = expected if isinstance(expected, dict) else {}
    bad = sorted(k for k in set(digests) | set(expected) if digests.get(k) != expected.get(k))
    raise CacheError(f"{len(bad)} file(s) differ from the manifest checksums, e.g. {bad[:3]}")
  return manifest


def _manifest_field(manifest: dict, *keys: str):
  """manifest[keys[0]][keys[1]]...; CacheError where the manifest lacks it."""
  value = manifest
  for key in keys:
    if not isinstance(value, dict) or key not in value:
      raise CacheError(f"manifest lacks {'.'.join(keys)}")
    value = value[key]
  return value


def _load_checked(entry: pathlib.Path, recipe: dict, role: str):
  """The `role` ("target" or "draft") checkpoint of `entry`, raising CacheError unless every
  check passes (manifest, file digests, restore, parameter fingerprint)."""
  manifest = _check_manifest(entry, recipe, "preset")
  try:
    trained = load_trained(entry / role, config=ModelConfig.from_dict(recipe[role]))
  except Exception as e:  # noqa: BLE001 (any failure to restore means a bad entry)
    raise CacheError(f"checkpoint does not restore: {_one_line(e)}") from e
  if params_fingerprint(trained.params) != _manifest_field(manifest, role, "fingerprint"):
    raise CacheError("parameter fingerprints differ from the manifest")
  return trained


@contextlib.contextmanager
def _lock(path: pathlib.Path, entry: pathlib.Path):
  """An exclusive `flock` on `path` for the block (one builder of `entry` at a time; the
  kernel drops it when the holder dies). The holder's pid is written into the file; a
  process that has to wait says so in one line naming `entry` and that pid, before it
  blocks (a first build takes minutes)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # not truncated: it names the holder
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 32, 0).decode("utf-8", "replace").strip()
      who = f"pid {holder}" if holder.isdigit() else "pid unknown"
      _log(f"waiting for another process ({who}) that is building or loading {entry}; "
           "this one goes on when it is done (a first build takes minutes)")
      fcntl.flock(fd, fcntl.LOCK_EX)
    try:  # best effort: the pid is only for the message above
      os.ftruncate(fd, 0)
      os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
      pass
    yield
  finally:
    os.close(fd)  # drops the flock


def _build_tokenizer(preset, corpus, out: pathlib.Path) -> Tokenizer:
  """The preset's tokenizer: the byte tokenizer, or a BPE trained on the corpus's training
  split (about a second) and saved first, so a resumed build reuses exactly the same one."""
  if preset.tokenizer == "byte":
    return ByteTokenizer()
  saved = out / "tokenizer.json"
  if saved.is_file():
    tokenizer = load_tokenizer(saved)
  else:
    n = preset.target.vocab_size
    tokenizer = BPETokenizer.train((d.text for d in corpus.train), n)
    if tokenizer.vocab_size != n:
      raise ValueError(f"the BPE trained on corpus {corpus.name!r} has {tokenizer.vocab_size} "
                       f"ids, not the {n} preset {preset.name!r} needs: use a smaller "
                       "vocabulary or a larger corpus")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(out)
  _log(f"tokenizer: {tokenizer!r}")
  return tokenizer


def _built(t0: float, role: str, trained, **extra) -> dict:
  """A manifest body (without recipe and file checksums) for a trained `role`."""
  return {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
          "build_seconds": round(time.perf_counter() - t0, 1),
          "python": platform.python_version(), **extra,
          role: {"fingerprint": params_fingerprint(trained.params), "val": trained.val}}


def build_target(preset_name: str, corpus_name: str, out: pathlib.Path, *,
                 progress: bool = True) -> dict:
  """Train the preset's tokenizer and target into `out` (resumable). Returns the manifest
  body (without recipe and file checksums)."""
  preset = get_preset(preset_name)
  t0 = time.perf_counter()
  corpus = load_corpus(corpus_name)
  tokenizer = _build_tokenizer(preset, corpus, out)
  data = TokenData.from_corpus(corpus, tokenizer)
  _log(corpus.summary())
  target = train(preset.target, preset.target_train, data, tokenizer, out_dir=out / "target",
                 role="target", progress=progress)
  _log("target: " + target.summary().replace("\n", "; "))
  tokenizer.save(out)
  return _built(t0, "target", target, corpus_fingerprint=corpus.fingerprint)


def build_draft(preset_name: str, corpus_name: str, target: DefaultTarget, out: pathlib.Path,
                *, progress: bool = True) -> dict:
  """Distill the preset's draft from `target` into `out` (resumable). Returns the manifest
  body (without recipe and file checksums)."""
  preset = get_preset(preset_name)
  t0 = time.perf_counter()
  corpus = load_corpus(corpus_name)
  data = TokenData.from_corpus(corpus, target.tokenizer)
  draft = train(preset.draft, preset.draft_train, data, target.tokenizer, out_dir=out / "draft",
                teacher=Teacher(preset.target, target.target_params), role="draft",
                progress=progress)
  _log("draft: " + draft.summary().replace("\n", "; "))
  return _built(t0, "draft", draft, corpus_fingerprint=corpus.fingerprint)


def corpus_of(preset: str, corpus: str | None) -> str:
  """`corpus`, or the preset's own corpus when None."""
  return get_preset(preset).corpus if corpus is None else corpus


def _check_default(preset: str, corpus: str) -> None:
  get_preset(preset)
  if corpus not in EMBEDDED:
    raise ValueError(f"corpus must be one of {EMBEDDED} for the default models, got {corpus!r}")


def load_default_target(preset: str = DEFAULT_PRESET, corpus: str | None = None, *,
                        progress: bool = True, rebuild: bool = False) -> DefaultTarget:
  """The trained default target (and its tokenizer) for `preset` on an embedded corpus (by
  default the preset's own).

  The shipped target (`training.shipped`) when the package holds one of this recipe;
  otherwise first use trains it into the cache (progress on stderr) and later uses load and
  verify it. rebuild=True ignores a shipped one, discards a cached entry and trains again.
  """
  corpus = corpus_of(preset, corpus)
  _check_default(preset, corpus)
  recipe = _recipe(preset, corpus)
  entry = entry_dir(preset, corpus)
  found = None if rebuild else shipped.entry(preset, corpus, recipe, "target")
  if found is not None:
    return DefaultTarget(*_shipped(shipped.load_target, *found, recipe))

  def verify_and_load(d: pathlib.Path) -> DefaultTarget:
    target = _load_checked(d, recipe, "target")
    return DefaultTarget(target.config, target.params, target.tokenizer)

  return _cached_build(
      entry, rebuild, verify_and_load,
      lambda partial: {"recipe": recipe, **build_target(preset, corpus, partial,
                                                         progress=progress)},
      unusable=f"cached target at {entry} is unusable", build_name="build",
      training=f"training the default {preset!r} target on the {corpus!r} corpus into {entry} "
      "(first use only)",
      ready=lambda _, body: f"default target ready in {entry} ({body['build_seconds']:.0f} s)")


def load_default_pair(preset: str = DEFAULT_PRESET, corpus: str | None = None, *,
                      progress: bool = True, rebuild: bool = False) -> DefaultPair:
  """The trained default (target, draft) pair for `preset` on an embedded corpus: the
  target (`load_default_target`) and the draft distilled from it.

  First use trains what is missing into the cache (progress on stderr); later uses load and
  verify it. rebuild=True discards both cached entries and trains again.
  """
  corpus = corpus_of(preset, corpus)
  target = load_default_target(preset, corpus, progress=progress, rebuild=rebuild)
  fingerprint = params_fingerprint(target.target_params)
  found = None if rebuild else shipped.entry(preset, corpus, _recipe(preset, corpus), "target")
  if found is not None:  # the shipped target: its draft is bound to the float32 original
    recipe = _draft_recipe(preset, corpus, shipped.target_fingerprint_float32(found[1]))
    found = shipped.entry(preset, corpus, recipe, "draft")
    if found is not None:
      draft = _shipped(shipped.load_model_params, *found, "draft", recipe["draft"])
      return DefaultPair(target.target_config, target.target_params,
                         ModelConfig.from_dict(recipe["draft"]), draft, target.tokenizer)
  recipe = _draft_recipe(preset, corpus, fingerprint)
  entry = draft_entry_dir(preset, corpus, fingerprint)

  def verify_and_load(d: pathlib.Path) -> DefaultPair:
    draft = _load_checked(d, recipe, "draft")
    return DefaultPair(target.target_config, target.target_params, draft.config, draft.params,
                       target.tokenizer)

  return _cached_build(
      entry, rebuild, verify_and_load,
      lambda partial: {"recipe": recipe, **build_draft(preset, corpus, target, partial,
                                                        progress=progress)},
      unusable=f"cached draft at {entry} is unusable", build_name="draft build",
      training=f"distilling the default {preset!r} draft from its target into {entry} "
      "(first use only)",
      ready=lambda _, body: f"default draft ready in {entry} ({body['build_seconds']:.0f} s)")


def _cached_build(entry: pathlib.Path, rebuild: bool, verify_and_load: Callable,
                  build: Callable, *, unusable: str, build_name: str, training: str,
                  ready: Callable):
  """The cache scheme of every default build, under a lock on `entry`: return
  verify_and_load(entry) when it passes (unless rebuild; a failure is logged as `unusable`);
  else discard the entry, build into `entry.partial` (build(partial) -> the manifest body,
  recipe included; a build interrupted there resumes), write the manifest with the files'
  digests, verify the partial and rename it into place (atomic: the entry appears complete or
  not at all). Logs `training` before and ready(result, body) after.

  A `.partial` left by an earlier build that cannot be resumed (a truncated tokenizer.json
  or checkpoint step, a build of another recipe; anything but an interrupt, a missing
  package or exhausted memory) is discarded with one line saying why, and the build starts
  over. What cannot be mended (an entry that cannot be moved aside, a fresh build that does
  not verify) raises `CacheEntryError`: one line naming the directory and what to do."""
  with _lock(entry.parent / f".{entry.name}.lock", entry):
    if entry.exists() and not rebuild:
      try:
        return verify_and_load(entry)
      except CacheError as e:
        _log(f"{unusable} ({e}); rebuilding")
    if entry.exists():
      _discard(entry, "cannot move {path} aside to rebuild it ({error}): remove it and "
               "re-run (or run `specjax train defaults`)")
    partial = entry.with_name(entry.name + ".partial")

    def build_and_verify():
      body = build(partial)
      manifest = {**body, "files": _file_digests(partial)}
      atomic_write(partial / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
      return verify_and_load(partial), body

    resuming = partial.exists()
    if resuming:
      _log(f"resuming an interrupted {build_name} in {partial}")
    _log(training)
    try:
      result, body = build_and_verify()
    except (ImportError, MemoryError):
      raise  # a fresh build would fail alike: keep what the partial holds
    except Exception as e:  # noqa: BLE001 (a partial that cannot be resumed is rebuilt)
      if not resuming:
        if isinstance(e, CacheError):
          raise CacheEntryError(
              f"the {build_name} just made in {partial} does not verify ({e}): remove "
              f"{partial} and re-run") from e
        raise
      _log(f"the interrupted {build_name} in {partial} cannot be resumed ({_one_line(e)}); "
           "discarding it and building from scratch")
      _discard(partial)
      try:
        result, body = build_and_verify()
      except CacheError as e:
        raise CacheEntryError(
            f"the {build_name} just made in {partial} does not verify ({e}): remove "
            f"{partial} and re-run") from e
    os.replace(partial, entry)
    _log(ready(result, body))
    return result


def _discard(path: pathlib.Path, refusal: str = "cannot remove the damaged build {path} "
             "({error}): remove it and re-run") -> None:
  """Removes `path` (a directory, or a file where one belongs): renamed aside first (one
  step, so a kill leaves nothing half-removed under its name), then deleted. Where it
  cannot be moved, CacheEntryError(refusal with {path} and {error} filled in)."""
  aside = path.with_name(f".{path.name}.bad-{os.getpid()}-{int(time.time())}")
  try:
    path.rename(aside)
  except OSError as e:
    raise CacheEntryError(refusal.format(path=path, error=_one_line(e))) from None
  if aside.is_dir() and not aside.is_symlink():
    shutil.rmtree(aside, ignore_errors=True)
  else:
    aside.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- default heads
#
# Draft heads (Medusa, EAGLE, ...) for the default target, built on first use (EAGLE by the
# quickstart's) and cached beside the target with the same lock / partial / manifest / digest
# scheme. One line per kind: (the kind's spec, its training schedule). Sized to train in
# about a minute on a 2-core CPU (BUILD_NOTES.md has the measured seconds and acceptance).

HEADS_FORMAT = 1
DEFAULT_HEADS: dict[str, tuple[dict, TrainConfig]] = {
    "medusa": ({"heads": 4, "decay": 0.8},
               TrainConfig(steps=60, batch_size=8, seq_len=128, lr=5e-3, warmup_steps=6,
                           eval_every=0, ckpt_every=30, eval_windows=32)),
    # width 128 (half the base target's d_model) at 360 steps: held-out top-1 0.765, a
    # drafting cycle (chain of 4) about the separate draft's cost; full width at 120 steps:
    # 0.73 at 1.35x that cost (BUILD_NOTES.md, "EAGLE head width"). Two unrolled drafting
    # steps: as good in the loop as three (tau 3.82 vs 3.73 at k = 4, T = 0) in 3/4 of the
    # time; the quickstart's first use trains it.
    "eagle": ({"steps": 2, "decay": 0.8, "layers": None, "width": 128},
              TrainConfig(steps=360, batch_size=8, seq_len=128, lr=3e-3, warmup_steps=20,
                          eval_every=0, ckpt_every=60, eval_windows=32)),
}


def heads_table(preset: str = DEFAULT_PRESET) -> dict[str, tuple[dict, TrainConfig]]:
  """The default heads' (spec, schedule) per kind for `preset`: its own, else DEFAULT_HEADS."""
  return get_preset(preset).heads or DEFAULT_HEADS


def default_head_spec(kind: str, target: ModelConfig, preset: str = DEFAULT_PRESET) -> dict:
  """The `kind` heads' spec for a target of this shape: the preset's table's, with an EAGLE
  width dropped (full width) where it is the target's d_model or a width the target cannot
  take (`eagle.head_config`'s rule)."""
  spec = dict(heads_table(preset)[kind][0])
  width = spec.get("width")
  if width is not None:
    try:
      narrower = head_config(target, width).d_model < target.d_model
    except ValueError:
      narrower = False
    if not narrower:
      spec.pop("width")
  return spec


def _heads_recipe(kind: str, preset: str, corpus: str, target_fingerprint: str) -> dict:
  spec = default_head_spec(kind, get_preset(preset).target, preset)
  tc = heads_table(preset)[kind][1]
  return {"format": HEADS_FORMAT, "kind": kind, "spec": spec, "train": dataclasses.asdict(tc),
          "target_entry": entry_dir(preset, corpus).name,
          "target_fingerprint": target_fingerprint}


def heads_entry_dir(kind: str, preset: str, corpus: str, target_fingerprint: str) -> pathlib.Path:
  recipe = _heads_recipe(kind, preset, corpus, target_fingerprint)
  return cache_dir() / "heads" / f"{preset}-{corpus}-{kind}-{_key(recipe)}"


def _verify_and_load_heads(entry: pathlib.Path, recipe: dict, target: DefaultTarget):
  manifest = _check_manifest(entry, recipe, "default heads")
  try:
    head = load_head(entry / "head", target=(target.target_config, target.target_params),
                     kind=recipe["kind"])
  except Exception as e:  # noqa: BLE001 (any failure to restore means a bad entry)
    raise CacheError(f"head checkpoint does not restore: {_one_line(e)}") from e
  if params_fingerprint(head.params) != _manifest_field(manifest, "fingerprint"):
    raise CacheError("head parameter fingerprint differs from the manifest")
  return head


def load_default_heads(kind: str = "medusa", preset: str = DEFAULT_PRESET,
                       corpus: str | None = None, *, progress: bool = True,
                       rebuild: bool = False):
  """The trained `kind` heads of the default target (a `heads.TrainedHead`).

  First use trains them into the cache (after the default target, if that is not built yet);
  later uses load and verify them (manifest recipe, file digests, the binding to the
  target, the parameter fingerprint). rebuild=True discards a cached entry first.
  """
  table = heads_table(preset)
  if kind not in table:
    raise ValueError(f"kind must be one of {sorted(table)} (the default heads), got {kind!r}")
  corpus = corpus_of(preset, corpus)
  target = load_default_target(preset, corpus, progress=progress)
  found = None if rebuild else shipped.entry(preset, corpus, _recipe(preset, corpus), "target")
  if found is not None:  # the shipped target: its heads are bound to the float32 original
    recipe = _heads_recipe(kind, preset, corpus, shipped.target_fingerprint_float32(found[1]))
    found = shipped.entry(preset, corpus, recipe, kind)
    if found is not None:
      return _shipped(shipped.load_head, *found, kind, recipe, target)
  recipe = _heads_recipe(kind, preset, corpus, TargetBinding.of(
      target.target_config, target.target_params).fingerprint)
  entry = heads_entry_dir(kind, preset, corpus, recipe["target_fingerprint"])

  def build(partial: pathlib.Path) -> dict:
    t0 = time.perf_counter()
    spec, tc = recipe["spec"], table[kind][1]
    data = TokenData.from_corpus(load_corpus(corpus), target.tokenizer)
    result = HeadTrainer(kind_from_spec(kind, spec), target.target_config, target.target_params,
                         tc, data, target.tokenizer, out_dir=partial / "head",
                         progress=progress).run()
    return {"recipe": recipe, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "build_seconds": round(time.perf_counter() - t0, 1),
            "python": platform.python_version(),
            "fingerprint": params_fingerprint(result.params),
            "acceptance": result.acceptance.to_dict()}

  return _cached_build(
      entry, rebuild, lambda d: _verify_and_load_heads(d, recipe, target), build,
      unusable=f"cached {kind} heads at {entry} are unusable", build_name=f"{kind} head build",
      training=f"training the default {kind} heads for the {preset!r} target into {entry} "
      "(first use only)",
      ready=lambda head, body: f"default {kind} heads ready in {entry} "
      f"({body['build_seconds']:.0f} s; {head.acceptance})")
