"""`openflash eval`: lm-evaluation-harness in-process over the engine (evaluation/harness.py), on tasks whose right
answers are known from the model itself (its likeliest next token), and held-out perplexity of a prepared folder;
every number against the teacher-forced forward."""

from __future__ import annotations

import json
import math

import pytest
import torch

from openflash.cli import main
from openflash.errors import OpenflashError
from openflash.evaluation.run import EvalConfig, run_eval, task_sources
from openflash.runtime.open import open_model

CONTEXTS = ["def add(a, b):\n    return", "import os\nimport", "for i in range(10):\n    print(", "class Point:\n",
            "x = [1, 2, 3]\ny =", "with open(path) as f:\n   ", "if __name__ ==", "while True:\n    if"]


@pytest.fixture(scope="module")
def tiny():
    return open_model("tiny")  # what `--model tiny` opens: seed 0, the released numerics


def _logp(rt, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(rt.forward(torch.tensor([ids])).logits[0].float(), dim=-1)


def _known_tasks(rt, folder) -> None:
    """A multiple-choice task whose right choice is the model's likeliest next token (the others: tokens that the
    tokenizer also keeps whole after the context), and an exact-match task whose target is that token's text."""
    tok = rt.tokenizer
    mc, exact = [], []
    for context in CONTEXTS:
        ids = tok.encode(context, add_special_tokens=False).ids
        logp = _logp(rt, ids)[-1]
        order = torch.argsort(logp, descending=True).tolist()

        def whole(t: int) -> bool:  # the choice's text tokenizes back to this one token after the context
            return tok.encode(context + tok.decode([t]), add_special_tokens=False).ids == ids + [t]

        best = order[0]
        if not whole(best) or "\n" in tok.decode([best]) or float(logp[order[0]] - logp[order[1]]) < 1e-3:
            continue
        others = [t for t in order[50:400] if whole(t)][:2]
        mc.append({"question": context, "choices": [tok.decode([t]) for t in [best, *others]], "answer": 0})
        exact.append({"question": context, "answer": tok.decode([best])})
    assert len(mc) >= 4
    for name, rows in (("mc", mc), ("exact", exact)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "known_mc.yaml").write_text(
        "task: known_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: mc.jsonl\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n")
    (folder / "known_exact.yaml").write_text(
        "task: known_exact\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: exact.jsonl\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "target_delimiter: ''\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 1\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def test_known_answers_score_as_expected_and_loglikelihoods_are_the_forward_s(tiny, tmp_path, monkeypatch):
    _known_tasks(tiny, tmp_path)
    monkeypatch.chdir(tmp_path)  # lm-eval reads a task's data files from the working folder
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    out = tmp_path / "results.json"
    assert main(["eval", "--model", "tiny", "--tasks", str(tmp_path), "--max-length", "64", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["results"]["known_mc"]["acc,none"] == 1.0
    assert results["results"]["known_exact"]["exact_match,none"] == 1.0
    tok, checked = tiny.tokenizer, 0
    for sample in results["samples"]["known_mc"]:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            right = continuation == sample["doc"]["choices"][0]
            blanks = len(context) - len(context.rstrip())  # lm-eval moves them to the continuation
            if blanks:
                context, continuation = context[:-blanks], context[-blanks:] + continuation
            ctx = tok.encode(context, add_special_tokens=False).ids
            whole = tok.encode(context + continuation, add_special_tokens=False).ids
            logp = _logp(tiny, whole)
            want = sum(float(logp[t - 1, whole[t]]) for t in range(len(ctx), len(whole)))
            assert abs(resp[0][0] - want) < 1e-4 and (resp[0][1] or not right or blanks)  # greedy: the argmax
            checked += 1
    assert checked == 3 * len(results["samples"]["known_mc"])


def test_held_out_perplexity_of_a_prepared_folder(tiny, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"f{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * 7}\n")
    tiny.tokenizer.save(str(tmp_path / "tok.json"))
    assert main(["data", "prepare", str(corpus), "--tokenizer", str(tmp_path / "tok.json"), "--out",
                 str(tmp_path / "data"), "--val-fraction", "0.2"]) == 0
    report = run_eval(EvalConfig(model="tiny", perplexity=str(tmp_path / "data"), limit=3, max_length=64))
    from openflash.train.dataset import TokenDataset

    val = TokenDataset(tmp_path / "data", "val")
    nll, count = 0.0, 0
    for i in range(3):  # documents shorter than 64 tokens: one window each, the whole document after its first
        doc = val.read(int(val.doc_offsets[i]), int(val.doc_offsets[i + 1] - val.doc_offsets[i])).tolist()
        assert len(doc) < 64
        logp = _logp(tiny, doc)
        nll -= sum(float(logp[t - 1, doc[t]]) for t in range(1, len(doc)))
        count += len(doc) - 1
    got = report["perplexity"]
    assert got["documents"] == 3 and got["tokens"] == count
    assert abs(got["nll_per_token"] - nll / count) < 1e-5  # fp32 sums of a few dozen log-probs
    assert math.isclose(got["perplexity"], math.exp(got["nll_per_token"]), rel_tol=1e-12)


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(OpenflashError, match="--tasks .* or --perplexity"):
        EvalConfig(model="tiny").validate()
    with pytest.raises(OpenflashError, match="no such task file"):
        task_sources((str(tmp_path / "absent.yaml"),))
    with pytest.raises(OpenflashError, match="unknown task"):
        run_eval(EvalConfig(model="tiny", tasks=("no_such_task_anywhere",)))
    assert main(["eval", "--model", "tiny", "--tasks", "x", "--limit", "0"]) == 2
