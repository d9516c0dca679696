"""`specjax bench` on a Hugging Face Llama pair with a chat template: the bring-your-own path
end to end (random weights written by transformers, a tokenizer and template written here)."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax import cli, resolve  # noqa: E402
from specjax.data.prompts import encode_prompt, load_prompts  # noqa: E402
from hf_testing import llama_dir as _llama_dir, theirs  # noqa: E402


@pytest.mark.slow
def test_bench_on_a_hf_pair_with_a_chat_template(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  target = _llama_dir(tmp_path / "target", 2, 0)
  draft = _llama_dir(tmp_path / "draft", 1, 1)
  questions = [{"question_id": 1, "category": "writing", "turns": ["write a poem about the sea"]},
               {"question_id": 2, "category": "chat", "turns": ["Hello, how are you?"]},
               {"question_id": 3, "category": "chat", "turns": ["the cat sat on the mat"]}]
  qs = tmp_path / "question.jsonl"
  qs.write_text("".join(json.dumps(q) + "\n" for q in questions))
  out = tmp_path / "run"
  assert cli.main(["bench", "--target", str(target), "--draft", str(draft), "--prompts",
                   str(qs), "--k", "3", "--max-new-tokens", "8", "--repeats", "1", "--out",
                   str(out), "--no-progress"]) == 0
  rows = {r["params"]["question"]: r["metrics"] for r in
          map(json.loads, (out / "results.jsonl").read_text().splitlines())}
  tok = resolve.load_target(str(target))[1]  # the cached import's tokenizer
  for q, prompt in zip(questions, load_prompts(qs)):
    ids = theirs(target, [{"role": "user", "content": q["turns"][0]}])
    assert encode_prompt(prompt, tok) == ids  # transformers' apply_chat_template, exactly
    m = rows[q["question_id"]]
    assert m["prompt_tokens"] == len(ids) and m["category"] == q["category"]
    assert m["identical_to_plain"] is True and m["new_tokens"] >= 1
  assert "| chat | 2 |" in (out / "report.md").read_text()
  assert len(list((tmp_path / "cache" / "hf").iterdir())) == 2  # both imported once, cached
