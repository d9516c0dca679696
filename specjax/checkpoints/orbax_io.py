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
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
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
  """Rebuild a config of class `cls` from `config_to_json` output (unknown fields rejected)."""
  known = {f.name for f in dataclasses.fields(cls)}
  fields = dict(data["fields"])
  extra = sorted(set(fields) - known)
  if extra:
    raise ValueError(f"checkpoint config has fields {extra} that {cls.__name__} does not know")
  for f in dataclasses.fields(cls):  # JSON turns tuples into lists
    if isinstance(fields.get(f.name), list):
      fields[f.name] = tuple(fields[f.name])
  return cls(**fields)


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
  """Shape/dtype structs placed on this process's default device.

  The placement is explicit so a checkpoint restores whatever devices saved it: without it
  orbax rebuilds the sharding stored in the checkpoint, which fails ("Topology mismatch") when
  it was written on another platform (a GPU) or with more devices than this process has.
  """
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=device),
                      tree)


def _shapes(tree: Any) -> dict[str, tuple]:
  """{'a/b/0': shape} for every leaf (dict and sequence keys alike become strings)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)
    out[name] = tuple(np.shape(leaf))
  return out


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
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    self._manager.close()

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

  def read_meta(self, step: int | None = None) -> dict:
    """The JSON item of a step (latest by default): {"config": ..., "metadata": ...}."""
    step = self._resolve(step)
    out = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
    return dict(out[META])

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

  def _stored_params(self, step: int) -> Any:
    """The stored parameter tree's metadata (leaves with shape and dtype)."""
    stored = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / PARAMS)
    return stored.tree if hasattr(stored, "tree") else stored

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
    meta = self.read_meta(step)
    if config is not None:
      diff = config_diff(with_defaults(meta["config"], type(config)), config_to_json(config))
      if diff:
        raise ValueError(f"checkpoint {str(self.directory)!r} step {step} was saved with a "
                         "different config:\n  " + "\n  ".join(diff))
    if params_target is not None:
      self._check_shapes(step, _to_saveable(params_target))
    if params_target is None:  # the stored structure, placed here (see _abstract)
      items = {PARAMS: ocp.args.StandardRestore(_abstract(self._stored_params(step)))}
    else:
      items = {PARAMS: ocp.args.StandardRestore(_abstract(_to_saveable(params_target)))}
    if opt_state_target is not None:
      items[OPT_STATE] = ocp.args.StandardRestore(_abstract(_to_saveable(opt_state_target)))
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(**items))
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"checkpoint {str(self.directory)!r} step {step} does not match the "
                       f"expected parameter structure: {e}") from e
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
