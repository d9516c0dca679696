"""Generic orbax save/restore of (params, config, optimizer state, step, metadata).

A checkpoint directory is an orbax `CheckpointManager` root: one sub-folder per step, each
holding up to three items:
  params     the parameters (any pytree; an `nnx.State` is stored as its pure dict)
  opt_state  the optimizer state (optional; any pytree)
  meta       JSON: {"config": {"class": ..., "fields": {...}}, "metadata": {...}}
               (metadata carries whatever the caller needs: data-order state, tokenizer spec,
               training config, role ...).
Orbax writes each step into a temporary folder and renames it when complete, so a killed
writer never leaves a step that looks finished; `keep` (orbax LatestN) keeps the last N steps.
Saving is synchronous: the checkpoints here are small and a kill right after `save` returns
must find the step on disk.

`restore(..., config=expected)` refuses a checkpoint whose stored config differs from the
expected one, naming each differing field.

Damaged checkpoints. Before orbax reads a step, the files it needs are checked (`check_step`:
the meta item, the params item, its array metadata and, for OCDBT, its manifest), so a
missing file is named without orbax being asked; anything that still fails while reading
(truncated or flipped bytes, unparseable JSON) becomes a ValueError naming the directory and
step and saying it is damaged. Orbax reads arrays in parallel on an asyncio loop that it
closes as soon as one read fails; the reads still in flight then report into the closed loop
("RuntimeError: Event loop is closed", one traceback each, through `sys.unraisablehook`,
then "Exception ignored in: <coroutine object _read_array_index_and_device_put>" when the
suspended reads are garbage-collected, and "Task (Future) exception was never retrieved"
through the `asyncio` logger). Reading a checkpoint therefore installs, once, filters that
drop exactly those messages (everything else goes to the previous hook / handlers).
Read-only access also drops absl's warnings and errors that name the directory being read:
orbax logs them each time it lists a step without (or with a garbled) _CHECKPOINT_METADATA
("Metadata file does not exist" for an empty step), which it tolerates; what stops a read is
raised instead (`check_step`, the restore).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import re
import sys
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from orbax.checkpoint import checkpoint_managers as ocm

PARAMS, OPT_STATE, META = "params", "opt_state", "meta"


def config_to_json(config: Any) -> dict:
  """A dataclass config as {"class": name, "fields": {...}} (JSON-ready)."""
  if config is None:
    return {"class": None, "fields": {}}
  if not dataclasses.is_dataclass(config):
    raise ValueError(f"config must be a dataclass instance, got {type(config).__name__}")
  fields = dataclasses.asdict(config)
  json.dumps(fields)  # fail here, not inside orbax, on a non-JSON field
  return {"class": type(config).__name__, "fields": fields}


def config_from_json(data: dict, cls: type) -> Any:
  """Rebuild a config of class `cls` from `config_to_json` output (unknown fields rejected;
  a stored config the class cannot take raises ValueError, never KeyError or TypeError)."""
  known = {f.name for f in dataclasses.fields(cls)}
  if not isinstance(data, dict) or not isinstance(data.get("fields"), dict):
    raise ValueError(f"checkpoint config must be {{'class': ..., 'fields': {{...}}}}, got "
                     f"{str(data)[:200]}")
  fields = dict(data["fields"])
  extra = sorted(set(fields) - known)
  if extra:
    raise ValueError(f"checkpoint config has fields {extra} that {cls.__name__} does not know")
  for f in dataclasses.fields(cls):  # JSON turns tuples into lists
    if isinstance(fields.get(f.name), list):
      fields[f.name] = tuple(fields[f.name])
  try:
    return cls(**fields)
  except TypeError as e:  # a required field missing
    raise ValueError(f"checkpoint config is not a valid {cls.__name__}: {e}") from None


def with_defaults(stored: dict, cls: type) -> dict:
  """`config_to_json` output with the fields a checkpoint written before they existed lacks
  filled in with the class's defaults (new fields' defaults keep the old behaviour)."""
  defaults = {f.name: f.default for f in dataclasses.fields(cls)
              if f.default is not dataclasses.MISSING}
  return {**stored, "fields": {**defaults, **stored.get("fields", {})}}


def config_diff(stored: dict, expected: dict) -> list[str]:
  """Lines 'field: checkpoint=X, expected=Y' for every differing field (and the class)."""
  lines = []
  if stored.get("class") != expected.get("class"):
    lines.append(f"class: checkpoint={stored.get('class')}, expected={expected.get('class')}")
  a, b = stored.get("fields", {}), expected.get("fields", {})
  for key in sorted(set(a) | set(b)):
    va, vb = a.get(key, "<missing>"), b.get(key, "<missing>")
    if isinstance(va, list):
      va = tuple(va)
    if isinstance(vb, list):
      vb = tuple(vb)
    if va != vb:
      lines.append(f"{key}: checkpoint={va!r}, expected={vb!r}")
  return lines


def _to_saveable(tree: Any) -> Any:
  """nnx.State -> nested pure dict; anything else unchanged."""
  if isinstance(tree, nnx.State):
    return nnx.to_pure_dict(tree)
  return tree


def _abstract(tree: Any) -> Any:
  """Shape/dtype structs placed on this process's default device, or where a leaf's
  `NamedSharding` says (a target from `sharding.abstract_params`: restored into place).

  The placement is explicit so a checkpoint restores whatever devices saved it: without it
  orbax rebuilds the sharding stored in the checkpoint, which fails ("Topology mismatch") when
  it was written on another platform (a GPU) or with more devices than this process has.
  """
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def placed(x):  # a target leaf that carries a mesh sharding is read into its shards
    sharding = getattr(x, "sharding", None)
    keep = isinstance(sharding, jax.sharding.NamedSharding)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding if keep else device)

  return jax.tree.map(placed, tree)


def _shapes(tree: Any) -> dict[str, tuple]:
  """{'a/b/0': shape} for every leaf (dict and sequence keys alike become strings)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)
    out[name] = tuple(np.shape(leaf))
  return out


def _is_aborted_read_noise(unraisable) -> bool:
  """Whether an unraisable exception is the echo of an aborted orbax read: a
  `RuntimeError('Event loop is closed')` (a read that orbax started on its asyncio loop
  finished after the loop was closed: orbax closes it on the first failure), or the error an
  orbax read coroutine left suspended by that abort raises when it is garbage-collected."""
  if unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed":
    return True
  code = getattr(unraisable.object, "cr_code", None)  # a coroutine being closed
  return code is not None and "orbax" in pathlib.Path(code.co_filename).parts


class _QuietUnraisableHook:
  """sys.unraisablehook without the aborted-read noise; all else goes to `previous`."""

  def __init__(self, previous) -> None:
    self.previous = previous

  def __call__(self, unraisable) -> None:
    if not _is_aborted_read_noise(unraisable):
      self.previous(unraisable)


_read_failed = False  # set once a read of a checkpoint has failed in this process
# asyncio's message for a Task, Future or _GatheringFuture whose exception nobody awaited
_NEVER_RETRIEVED = re.compile(r"\w+ exception was never retrieved\b")


class _AbortedTaskFilter(logging.Filter):
  """Drops asyncio's "Task (Future) exception was never retrieved" for a read of an aborted
  orbax restore (its error is the one the restore already raised): one that names
  tensorstore or OCDBT, or any once a checkpoint read has failed in this process (a bare
  tensorstore error names neither)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if not _NEVER_RETRIEVED.match(str(record.msg)):
      return True
    exc = record.exc_info[1] if record.exc_info else None
    text = f"{exc} {record.msg}".lower()
    return not (_read_failed or "tensorstore" in text or "ocdbt" in text)


class _DirectoryLogFilter(logging.Filter):
  """Drops absl records up to ERROR that name `directory` (while it is read only): orbax
  tolerates a step without (or with a garbled) _CHECKPOINT_METADATA but logs it each time it
  lists the step; whatever stops a read is raised by `check_step` or the restore instead."""

  def __init__(self, directory: pathlib.Path) -> None:
    super().__init__()
    self.directory = str(directory)

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno > logging.ERROR or self.directory not in record.getMessage()


def _quiet_aborted_reads() -> None:
  """Install the hook and asyncio filter of the module doc (once; again if something
  replaced the hook, as pytest does around each test)."""
  if not isinstance(sys.unraisablehook, _QuietUnraisableHook):
    sys.unraisablehook = _QuietUnraisableHook(sys.unraisablehook)
  log = logging.getLogger("asyncio")
  if not any(isinstance(f, _AbortedTaskFilter) for f in log.filters):
    log.addFilter(_AbortedTaskFilter())


def _reason(e: BaseException) -> str:
  """The most specific message of a failed orbax / tensorstore read, on one short line: the
  innermost cause (orbax wraps tensorstore's error in a bare Exception whose own text is a
  repr of the TensorStore), without the JSON spec tensorstore appends."""
  seen = {id(e)}
  while e.__cause__ is not None and id(e.__cause__) not in seen:
    e = e.__cause__
    seen.add(id(e))
  text = " ".join(str(e).split()) or type(e).__name__
  text = text.split(" [tensorstore_spec")[0]
  return text if len(text) <= 300 else f"{text[:100]} ... {text[-195:]}"  # the cause is last


class Restored(NamedTuple):
  step: int
  params: Any
  opt_state: Any
  config: dict          # config_to_json form as stored
  metadata: dict


class Checkpointer:
  """A checkpoint directory: `save` steps, `restore` the latest or a given one.

  Use as a context manager (or call `close`). keep: how many recent steps to keep (None: all).
  """

  def __init__(self, directory: str | pathlib.Path, *, keep: int | None = 3,
               read_only: bool = False) -> None:
    if keep is not None and keep < 1:
      raise ValueError(f"keep must be >= 1 or None, got {keep}")
    self.directory = pathlib.Path(directory).absolute()
    if read_only and not self.directory.is_dir():
      raise ValueError(f"checkpoint directory {str(directory)!r} does not exist")
    # read_only here means "never create or clean": orbax's own read_only flag only adds
    # warnings, and restoring never writes anyway.
    options = ocp.CheckpointManagerOptions(
        create=not read_only, enable_async_checkpointing=False,
        cleanup_tmp_directories=not read_only,
        preservation_policy=ocm.LatestN(keep) if keep is not None else None)
    self._absl_filter = None
    if read_only:  # listing a damaged step makes orbax warn; check_step names the damage
      self._absl_filter = _DirectoryLogFilter(self.directory)
      logging.getLogger("absl").addFilter(self._absl_filter)
    try:
      self._manager = ocp.CheckpointManager(self.directory, options=options)
    except BaseException:
      self._remove_filter()
      raise

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _remove_filter(self) -> None:
    if self._absl_filter is not None:
      logging.getLogger("absl").removeFilter(self._absl_filter)
      self._absl_filter = None

  def close(self) -> None:
    try:
      self._manager.close()
    finally:
      self._remove_filter()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, *, params: Any, config: Any = None, opt_state: Any = None,
           metadata: dict | None = None) -> pathlib.Path:
    """Write step `step` atomically (replacing an existing step of that number)."""
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    meta = {"config": config_to_json(config), "metadata": metadata or {}}
    json.dumps(meta)  # JSON-ready or fail now
    items = {PARAMS: ocp.args.StandardSave(_to_saveable(params)),
             META: ocp.args.JsonSave(meta)}
    if opt_state is not None:
      items[OPT_STATE] = ocp.args.StandardSave(_to_saveable(opt_state))
    if step in self._manager.all_steps():
      self._manager.delete(step)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    self._manager.wait_until_finished()
    return self.directory / str(step)

  def _damaged(self, step: int, what: str) -> ValueError:
    return ValueError(f"checkpoint {str(self.directory)!r} step {step} is damaged: {what} "
                      f"(write it again, or restore it from an intact copy)")

  def check_step(self, step: int, items: tuple[str, ...] = (META, PARAMS)) -> None:
    """ValueError naming the file if step `step` lacks one that orbax needs to read `items`:
    the meta item's JSON file; an array item (params, opt_state), its array metadata and,
    when stored with OCDBT, its manifest. Checked before orbax is asked (see module doc)."""
    root = self.directory / str(step)
    for item in items:
      where = root / item
      if not where.is_dir():
        present = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
        raise self._damaged(step, f"its {item!r} item ({where}) is missing; the step holds "
                            f"{present or 'nothing'}")
      if item == META:
        if not (where / "metadata").is_file():
          raise self._damaged(step, f"its metadata file {where / 'metadata'} is missing")
        continue
      layout_file = where / "_METADATA"
      if not layout_file.is_file():
        continue  # a layout without it: orbax itself decides
      try:
        layout = json.loads(layout_file.read_bytes())
      except (ValueError, UnicodeError) as e:
        raise self._damaged(step, f"its array metadata {layout_file} is not valid JSON "
                            f"({e})") from None
      if not isinstance(layout, dict):
        raise self._damaged(step, f"its array metadata {layout_file} is not a JSON object")
      if layout.get("use_ocdbt") and not (where / "manifest.ocdbt").is_file():
        raise self._damaged(step, f"its OCDBT manifest {where / 'manifest.ocdbt'} is missing")

  def read_meta(self, step: int | None = None) -> dict:
    """The JSON item of a step (latest by default): {"config": ..., "metadata": ...}.
    A missing or unreadable item, or one of another shape, raises ValueError naming the
    file."""
    step = self._resolve(step)
    self.check_step(step, (META,))
    path = self.directory / str(step) / META / "metadata"
    _quiet_aborted_reads()
    try:
      meta = self._manager.restore(
          step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    except Exception as e:  # noqa: BLE001 (bad JSON, bad bytes: the file is damaged)
      raise self._damaged(step, f"cannot read its metadata {path}: {_reason(e)}") from None
    if (not isinstance(meta, dict) or not isinstance(meta.get("config"), dict)
        or not isinstance(meta.get("metadata", {}), dict)):
      raise self._damaged(step, f"its metadata {path} is not "
                          f"{{'config': {{...}}, 'metadata': {{...}}}}")
    return {**meta, "metadata": meta.get("metadata", {})}

  def _resolve(self, step: int | None) -> int:
    steps = self.all_steps()
    if not steps:
      raise ValueError(f"no checkpoint found in {str(self.directory)!r}")
    if step is None:
      return steps[-1]
    if step not in steps:
      raise ValueError(f"step {step} is not in checkpoint {str(self.directory)!r}; "
                       f"available steps: {steps}")
    return step

  def _stored_params(self, step: int, item: str = PARAMS) -> Any:
    """The stored tree's metadata (leaves with shape and dtype) of an array item."""
    stored = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / item)
    return stored.tree if hasattr(stored, "tree") else stored

  def _same_shapes(self, step: int, item: str, target: Any) -> bool:
    """Whether the stored leaf names and shapes of `item` are the target's (False when its
    metadata cannot be read)."""
    try:
      return _shapes(self._stored_params(step, item)) == _shapes(target)
    except Exception:  # noqa: BLE001
      return False

  def _check_shapes(self, step: int, target: Any) -> None:
    """Compare stored parameter shapes with the target's before orbax reads anything."""
    try:
      stored = _shapes(self._stored_params(step))
    except Exception:  # noqa: BLE001 (no metadata: let orbax itself complain)
      return
    expected = _shapes(target)
    problems = [f"{k}: missing from checkpoint" for k in sorted(set(expected) - set(stored))]
    problems += [f"{k}: not expected" for k in sorted(set(stored) - set(expected))]
    problems += [f"{k}: checkpoint shape {stored[k]}, expected {expected[k]}"
                 for k in sorted(set(stored) & set(expected)) if stored[k] != expected[k]]
    if problems:
      raise ValueError(f"checkpoint {str(self.directory)!r} step {step} does not match the "
                       f"expected parameter structure ({len(problems)} difference(s)):\n  "
                       + "\n  ".join(problems[:8]))

  def restore(self, step: int | None = None, *, params_target: Any = None,
              config: Any = None, opt_state_target: Any = None) -> Restored:
    """Restore a step (latest by default).

    params_target / opt_state_target: trees (concrete or abstract) giving structure, shapes and
      dtypes; an nnx.State target gives an nnx.State back. Without a target the params come back
      as orbax stored them (nested dicts of arrays). opt_state is restored only with a target.
    config: the expected config (dataclass); a different stored config raises ValueError that
      lists the differing fields.
    """
    step = self._resolve(step)
    self.check_step(step, (META, PARAMS) + ((OPT_STATE,) if opt_state_target is not None
                                            else ()))
    meta = self.read_meta(step)
    if config is not None:
      diff = config_diff(with_defaults(meta["config"], type(config)), config_to_json(config))
      if diff:
        raise ValueError(f"checkpoint {str(self.directory)!r} step {step} was saved with a "
                         "different config:\n  " + "\n  ".join(diff))
    _quiet_aborted_reads()
    if params_target is not None:
      self._check_shapes(step, _to_saveable(params_target))
    # params of the expected shapes (checked above) and an optimizer state whose stored
    # shapes are the target's: a failure to read is the checkpoint's damage
    matched = (opt_state_target is None
               or self._same_shapes(step, OPT_STATE, _to_saveable(opt_state_target)))
    try:
      if params_target is None:  # the stored structure, placed here (see _abstract)
        items = {PARAMS: ocp.args.StandardRestore(_abstract(self._stored_params(step)))}
      else:
        items = {PARAMS: ocp.args.StandardRestore(_abstract(_to_saveable(params_target)))}
      if opt_state_target is not None:
        items[OPT_STATE] = ocp.args.StandardRestore(_abstract(_to_saveable(opt_state_target)))
      out = self._manager.restore(step, args=ocp.args.Composite(**items))
    except MemoryError:
      raise
    except Exception as e:  # noqa: BLE001 (orbax raises bare Exception for damaged data)
      global _read_failed
      _read_failed = True
      if matched:
        raise self._damaged(step, f"cannot read its arrays: {_reason(e)}") from None
      raise ValueError(f"checkpoint {str(self.directory)!r} step {step} cannot be read: it is "
                       f"damaged or its optimizer state is not the expected structure: "
                       f"{_reason(e)}") from None
    params = out[PARAMS]
    if isinstance(params_target, nnx.State):
      state = jax.tree.map(lambda x: x, params_target)  # a copy to fill in
      nnx.replace_by_pure_dict(state, params)
      params = state
    opt_state = out[OPT_STATE] if opt_state_target is not None else None
    if opt_state_target is not None and isinstance(opt_state_target, nnx.State):
      state = jax.tree.map(lambda x: x, opt_state_target)
      nnx.replace_by_pure_dict(state, opt_state)
      opt_state = state
    return Restored(step, params, opt_state, meta["config"], meta.get("metadata", {}))


def save(directory: str | pathlib.Path, step: int, *, params: Any, config: Any = None,
         opt_state: Any = None, metadata: dict | None = None,
         keep: int | None = 3) -> pathlib.Path:
  """One-shot save of a step into `directory` (see Checkpointer.save)."""
  with Checkpointer(directory, keep=keep) as ckpt:
    return ckpt.save(step, params=params, config=config, opt_state=opt_state, metadata=metadata)


def restore(directory: str | pathlib.Path, *, params_target: Any = None, config: Any = None,
            opt_state_target: Any = None, step: int | None = None) -> Restored:
  """One-shot restore (see Checkpointer.restore); never creates or cleans the directory."""
  with Checkpointer(directory, keep=None, read_only=True) as ckpt:
    return ckpt.restore(step, params_target=params_target, config=config,
                        opt_state_target=opt_state_target)


def read_meta(directory: str | pathlib.Path, step: int | None = None) -> dict:
  with Checkpointer(directory, keep=None, read_only=True) as ckpt:
    return ckpt.read_meta(step)


def check_step(directory: str | pathlib.Path, step: int | None = None) -> None:
  """Checkpointer.check_step of a step (latest by default) of `directory`: ValueError naming
  the missing or unreadable file of a damaged step."""
  with Checkpointer(directory, keep=None, read_only=True) as ckpt:
    ckpt.check_step(ckpt._resolve(step))


LISTING_ATTEMPTS = 5


def latest_step(directory: str | pathlib.Path) -> int | None:
  """The newest complete step in `directory`, or None (also for a missing directory).

  Safe to call while another process trains into `directory`: a writer that keeps the last
  N steps deletes an old step while this listing may be reading it (orbax then raises
  FileNotFoundError for the vanished step); the listing is taken again, up to
  LISTING_ATTEMPTS times."""
  for attempt in range(LISTING_ATTEMPTS):
    if not pathlib.Path(directory).is_dir():
      return None
    try:
      with Checkpointer(directory, keep=None, read_only=True) as ckpt:
        return ckpt.latest_step()
    except FileNotFoundError:
      if attempt == LISTING_ATTEMPTS - 1:
        raise
  return None
