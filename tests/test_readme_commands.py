"""Every `specjax ...` command that README.md and the comments of configs/*.gin show is
parsed by the real CLI parser, and every `specjax run` among them also loads its config
with its command-line changes and expands its points (none is run): a documented command
that stops with a usage or config error fails here, not in a reader's terminal.

Also the command line's merge semantics (`specjax.sweeps.overrides`): `--set`, `--axis`,
and `--gin_param` bindings of `Sweep.fixed` / `Sweep.axes` change the config's sweep key by
key, and a malformed change is one line naming its flag.
"""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

from specjax import cli
from specjax.sweeps import launch, overrides, runner

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CONFIGS = sorted((ROOT / "configs").glob("*.gin"))


def _logical_lines(lines: list[str]) -> list[str]:
  """Lines with their `\\` continuations joined (a shell would join them the same way)."""
  out, pending = [], ""
  for line in lines:
    if line.rstrip().endswith("\\"):
      pending += line.rstrip()[:-1] + " "
    else:
      out.append(pending + line)
      pending = ""
  return out + ([pending] if pending else [])


def _commands(line: str) -> list[list[str]]:
  """The `specjax` commands of one shell line (argv without `specjax`): segments between
  `&&`, comments dropped."""
  segments, current = [], []
  for token in shlex.split(line, comments=True) + ["&&"]:
    if token == "&&":
      segments.append(current)
      current = []
    else:
      current.append(token)
  return [s[1:] for s in segments if s[:1] == ["specjax"]]


def readme_commands() -> list[list[str]]:
  """The commands of README.md's fenced shell blocks, and the `--gin_param` example its prose
  gives for the main job (quickstart)."""
  text = README.read_text()
  blocks = re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", text, re.M | re.S)
  found = [c for b in blocks for line in _logical_lines(b.splitlines()) for c in _commands(line)]
  for example in re.findall(r"`(--gin_param\s+'[^']*')`", text):
    found.append(["run", "configs/quickstart.gin", *shlex.split(" ".join(example.split()))])
  return found


def config_commands() -> list[list[str]]:
  """The commands in the comments of configs/*.gin (`#   specjax run ... \\` continued on
  the next comment line)."""
  found = []
  for path in CONFIGS:
    comments = [line.lstrip("#").strip() for line in path.read_text().splitlines()
                if line.startswith("#")]
    found += [c for line in _logical_lines(comments) if line.startswith("specjax ")
              for c in _commands(line)]  # prose lines are not shell
  return found


COMMANDS = readme_commands() + config_commands()
RUNS = [c for c in COMMANDS if c[0] == "run"]


def _id(argv: list[str]) -> str:
  return " ".join(argv)[:90]


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
  monkeypatch.chdir(ROOT)  # the commands name configs/NAME.gin from the repository root


@pytest.fixture(scope="module")
def parser():
  return cli.build_parser()


def _points(argv: list[str], parser) -> list[runner.Point]:
  """The points a `specjax run` command would run (this process's shard), none of them run."""
  args = parser.parse_args(argv)
  sweep, _ = launch.load_sweep(args.config, args.gin_param, args.changes)
  if args.num_processes is not None:  # multi-host: the shard is the process
    return launch.plan(sweep, args.process_id, args.num_processes)
  return launch.plan(sweep, args.shard_index, args.num_shards)


def test_the_documents_show_the_commands_expected():
  assert len(readme_commands()) >= 30
  configs_run = {c[1] for c in RUNS}
  for path in CONFIGS:  # every config shows how to run it
    assert f"configs/{path.name}" in configs_run, path.name
  subcommands = {c[0] for c in COMMANDS}
  assert {"run", "merge", "generate", "check-exact", "train", "theory", "import-hf",
          "inspect"} <= subcommands
  assert any("--coordinator" in c for c in RUNS)  # a `\` continuation was joined
  assert any(c[1] == "configs/quickstart.gin" and "--gin_param" in c for c in RUNS)


@pytest.mark.parametrize("argv", COMMANDS, ids=_id)
def test_every_documented_command_parses(argv, parser):
  args = parser.parse_args(argv)  # a usage error exits (SystemExit) and fails the test
  assert args.command == argv[0] and callable(args.func)


@pytest.mark.parametrize("argv", RUNS, ids=_id)
def test_every_documented_run_command_expands(argv, parser):
  assert len(_points(argv, parser)) >= 1


def test_readme_drafter_example_sweeps_both_drafters_and_keeps_the_config(parser):
  """The README's quickstart example: "drafter" is fixed in quickstart.gin and an axis on
  the command line (it stopped with "both a sweep axis and fixed")."""
  (argv,) = [c for c in RUNS if c[1] == "configs/quickstart.gin" and "--gin_param" in c]
  points = _points(argv, parser)
  assert sorted(p.params["drafter"] for p in points) == ["eagle", "model"]
  assert all(p.params["max_new_tokens"] == 64 and p.params["k"] == 4 for p in points)
  same = _points(["run", "configs/quickstart.gin", "--axis", "mode=chain", "--axis",
                  "batch=1", "--axis", "temperature=0.0", "--axis", "drafter=eagle,model"],
                 parser)
  assert [p.params for p in same] == [p.params for p in points]


def test_alpha_k_fixed_binding_keeps_the_other_fixed_values(parser):
  """`sweeps.Sweep.fixed = {"c": 0.05}` replaced the whole dict (max_new_tokens 128 -> the
  point's default 96); now it changes c only, as `--set c=0.05` does."""
  gin_form = _points(["run", "configs/alpha_k_sweep.gin", "--gin_param",
                      'sweeps.Sweep.fixed = {"c": 0.05}'], parser)
  set_form = _points(["run", "configs/alpha_k_sweep.gin", "--set", "c=0.05"], parser)
  assert len(gin_form) == 30 and [p.params for p in gin_form] == [p.params for p in set_form]
  for p in gin_form:
    assert p.params["c"] == 0.05 and p.params["max_new_tokens"] == 128
    assert p.params["draft"] == "default" and p.params["mc_cycles"] == 20000


# ----------------------------------------------------------------------------- --set, --axis


@pytest.mark.parametrize("text, key, value", [
    ("c=0.05", "c", 0.05), ("max_new_tokens=32", "max_new_tokens", 32), ("c=None", "c", None),
    ("models=default", "models", "default"), ("draft=eagle:default", "draft", "eagle:default"),
    ("tree_widths=(2, 1)", "tree_widths", (2, 1)), ("tree_widths=2,1", "tree_widths", (2, 1)),
    ("side_by_side=True", "side_by_side", True), ("name='a b'", "name", "a b"),
    (" k = 3 ", "k", 3)])
def test_set_values_are_literals_or_strings(text, key, value):
  assert overrides.parse_set(text) == overrides.Override("set", key, value)


@pytest.mark.parametrize("text, values", [
    ("drafter=eagle,model", ["eagle", "model"]), ("batch=1,8", [1, 8]),
    ("batch=[1, 8]", [1, 8]), ("batch=4", [4]), ("mode=chain", ["chain"]),
    ("tree_widths=(2, 1),(1, 1)", [(2, 1), (1, 1)]), ("x=1,eagle", [1, "eagle"]),
    ("c=None,0.05", [None, 0.05])])
def test_axis_values(text, values):
  assert overrides.parse_axis(text).value == values


@pytest.mark.parametrize("flag, value, says", [
    ("--set", "c", "expected KEY=VALUE"), ("--set", "=3", "expected KEY=VALUE"),
    ("--set", "max new=3", "expected KEY=VALUE"), ("--set", "c=", "no value after '='"),
    ("--set", "c=[1,", "is not a Python literal"), ("--set", "c='open", "not a Python literal"),
    ("--axis", "k=", "no value after '='"), ("--axis", "k=1,,2", "an empty value"),
    ("--axis", "k=[]", "no values"), ("--axis", "mode", "expected KEY=VALUE"),
    ("--axis", "k=(1,2),(3", "not a Python literal")])
def test_a_malformed_change_is_one_line_naming_flag_and_value(flag, value, says, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["run", "quickstart", flag, value])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "Traceback" not in err
  assert err.startswith(f"specjax: error: argument {flag}: ") and says in err
  assert repr(value.strip()) in err or repr(value) in err


def test_an_unknown_parameter_is_named_with_the_closest_one(tmp_path, capsys):
  code = cli.main(["run", "quickstart", "--set", "max_new_token=3", "--out",
                   str(tmp_path / "r")])
  err = capsys.readouterr().err
  assert code == 2 and err.count("\n") == 1
  assert "'max_new_token'" in err and "did you mean max_new_tokens" in err
  assert not (tmp_path / "r").exists()  # refused before any work


# ----------------------------------------------------------------------------- merging


def _sweep(config: str, bindings=(), changes=()):
  return launch.load_sweep(config, bindings, [
      overrides.parse_set(c[4:]) if c.startswith("set ") else overrides.parse_axis(c[5:])
      for c in changes])[0]


def test_set_replaces_one_fixed_key_and_an_axis_of_that_name():
  base = _sweep("quickstart")
  s = _sweep("quickstart", changes=["set max_new_tokens=32", "set batch=1"])
  assert s.fixed == {**base.fixed, "max_new_tokens": 32, "batch": 1}
  assert s.axes == {k: v for k, v in base.axes.items() if k != "batch"}


def test_axis_adds_or_replaces_one_axis_and_drops_that_fixed_key():
  base = _sweep("quickstart")
  s = _sweep("quickstart", changes=["axis drafter=eagle,model", "axis batch=1"])
  assert s.axes == {**base.axes, "batch": [1], "drafter": ["eagle", "model"]}
  assert s.fixed == {k: v for k, v in base.fixed.items() if k != "drafter"}


def test_changes_apply_in_order_after_the_bindings():
  s = _sweep("quickstart", ['sweeps.Sweep.fixed = {"k": 2}'],
             ["set k=3", "axis k=1,2", "set batch=1", "axis batch=1,8"])
  assert s.axes["k"] == [1, 2] and s.axes["batch"] == [1, 8]
  assert "k" not in s.fixed and "batch" not in s.fixed


def test_gin_bindings_merge():
  base = _sweep("quickstart")
  fixed = _sweep("quickstart", ['sweeps.Sweep.fixed = {"k": 2, "temperature": 0.0}'])
  assert fixed.fixed == {**base.fixed, "k": 2, "temperature": 0.0}
  assert fixed.axes == {k: v for k, v in base.axes.items() if k != "temperature"}
  axes = _sweep("quickstart", ['sweeps.Sweep.axes = {"mode": ["chain"], "k": [1, 2]}'])
  assert axes.axes == {"mode": ["chain"], "k": [1, 2]}
  assert axes.fixed == {k: v for k, v in base.fixed.items() if k != "k"}


def test_one_binding_giving_a_key_both_ways_is_still_refused():
  s = _sweep("quickstart", ['sweeps.Sweep.axes = {"mode": ["chain"], "k": [1, 2]}\n'
                           'sweeps.Sweep.fixed = {"k": 3}'])
  with pytest.raises(ValueError, match="both a sweep axis and fixed"):
    launch.plan(s)


def test_a_vectorised_axis_made_fixed_leaves_vectorized():
  s = _sweep("alpha_k_sweep", changes=["set alpha=0.8"])
  assert s.vectorized == () and s.fixed["alpha"] == 0.8 and len(launch.plan(s)) == 6
  assert _sweep("alpha_k_sweep", changes=["axis alpha=0.8"]).vectorized == ("alpha",)


def test_no_change_keeps_the_operative_config_and_so_the_fingerprint():
  plain = launch.load_sweep("quickstart")[1]
  assert launch.load_sweep("quickstart", ["sweeps.Sweep.fixed = {}"])[1] == plain
  assert launch.load_sweep("quickstart", [], [overrides.parse_set("k=4")])[1] == plain


def test_the_operative_config_holds_the_merged_values(tmp_path):
  """A run directory's config.gin reloads to the same sweep (as `specjax merge` reloads it)."""
  s, text = launch.load_sweep("alpha_k_sweep", ['sweeps.Sweep.fixed = {"c": 0.05}'])
  (tmp_path / "config.gin").write_text(text)
  again, _ = launch.load_sweep(str(tmp_path / "config.gin"))
  assert again.fixed == s.fixed and again.fixed["max_new_tokens"] == 128
  assert again.axes == s.axes and again.vectorized == s.vectorized


def test_merge_binding_leaves_non_dicts_for_check_to_report():
  assert overrides.merge_binding(({}, {"a": 1}), ({}, [1])) == ({}, [1])
  with pytest.raises(ValueError, match="Sweep.fixed must be a dict"):
    _sweep("quickstart", ["sweeps.Sweep.fixed = [1]"], ["set k=3"])
