"""`openflash eval`: a model (preset, checkpoint or run folder, with a LoRA adapter if given) scored on lm-eval tasks
(names from lm-eval's registry, or task YAML files and folders of one's own), or on the held-out split of a
prepared data folder (perplexity), in-process through the engine (evaluation/harness.py); the results JSON written
as lm-eval writes it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openflash.errors import OpenflashError


@dataclass(frozen=True)
class EvalConfig:
    model: str
    tasks: tuple[str, ...] = ()  # lm-eval task names, or YAML files / folders of tasks
    perplexity: str | None = None  # a prepared data folder: its validation split's perplexity
    lora: str | None = None  # an adapter folder or `train --lora` run, evaluated on the model
    limit: int | None = None  # the first N examples of each task (N documents for perplexity)
    num_fewshot: int | None = None
    max_length: int = 2048  # the most positions a scored window predicts, or a prompt and its generation hold
    max_batch: int = 16  # sequences the engine runs together
    apply_chat_template: bool = False
    seed: int = 1234
    numerics: str = "fp32"
    tokenizer: str | None = None
    out: str | None = None

    def validate(self) -> "EvalConfig":
        if bool(self.tasks) == (self.perplexity is not None):
            raise OpenflashError("give --tasks (lm-eval tasks) or --perplexity DATA_DIR (a prepared folder), one of "
                                 "them")
        for name, value, low in (("--limit", self.limit, 1), ("--num-fewshot", self.num_fewshot, 0),
                                 ("--max-length", self.max_length, 2), ("--max-batch", self.max_batch, 1)):
            if value is not None and value < low:
                raise OpenflashError(f"{name} must be >= {low}, got {value}")
        return self


def task_sources(tasks: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """lm-eval task names and the folders to include for them: a YAML file gives its `task:` name and its folder,
    a folder every task in it (its YAML files' names); anything else is a registry name."""
    names, include = [], []
    for item in tasks:
        path = Path(item)
        if path.is_dir():
            found = [_task_name(p) for p in sorted(path.glob("*.yaml"))]
            if not found:
                raise OpenflashError(f"--tasks {item}: the folder holds no task YAML file")
            names += [n for n in found if n is not None]
            include.append(str(path.resolve()))
        elif path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                raise OpenflashError(f"--tasks {item}: no such task file")
            name = _task_name(path)
            if name is None:
                raise OpenflashError(f"--tasks {item}: the file has no `task:` name")
            names.append(name)
            include.append(str(path.resolve().parent))
        else:
            names.append(item)
    return names, sorted(set(include))


def _task_name(path: Path) -> str | None:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("task:"):
            return line.split(":", 1)[1].strip().strip("'\"") or None
    return None


def run_eval(cfg: EvalConfig) -> dict[str, Any]:
    """Evaluate; the results (lm-eval's dict, or the perplexity report), also written to cfg.out."""
    cfg.validate()
    from openflash.chat import chat_format
    from openflash.engine.engine import EngineConfig, LLMEngine
    from openflash.evaluation.harness import EngineLM
    from openflash.runtime.open import open_model

    runtime = open_model(cfg.model, cfg.tokenizer, cfg.numerics)
    if cfg.lora is not None:
        runtime.load_adapters({"adapter": cfg.lora})
    engine = LLMEngine(runtime, EngineConfig(max_batch=cfg.max_batch, max_context=cfg.max_length + 2,
                                             max_step_tokens=max(2048, cfg.max_length), prefix_cache=False))
    fmt = chat_format(runtime.tokenizer, runtime.cfg.bos_token_id, runtime.cfg.eos_token_id) \
        if cfg.apply_chat_template else None
    lm = EngineLM(engine, cfg.max_length, "adapter" if cfg.lora is not None else None, fmt)
    if cfg.perplexity is not None:
        from openflash.evaluation.perplexity import held_out_perplexity

        results: dict[str, Any] = {"perplexity": held_out_perplexity(lm, cfg.perplexity, cfg.limit),
                                   "model": cfg.model, "lora": cfg.lora, "max_length": cfg.max_length}
    else:
        results = _lm_eval(lm, cfg)
    if cfg.out is not None:
        from lm_eval.utils import handle_non_serializable

        out = Path(cfg.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")
    return results


def _lm_eval(lm: Any, cfg: EvalConfig) -> dict[str, Any]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # no download at run time: local or cached data only
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    names, include = task_sources(cfg.tasks)
    manager = TaskManager(include_path=include or None)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise OpenflashError(f"--tasks: unknown task(s) {unknown}: give lm-eval task names (`lm_eval ls tasks`), "
                             f"task YAML files or folders of them")
    try:
        results = simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=cfg.limit,
                                  num_fewshot=cfg.num_fewshot, apply_chat_template=cfg.apply_chat_template,
                                  log_samples=True, random_seed=cfg.seed, numpy_random_seed=cfg.seed,
                                  torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed)
    except OpenflashError:
        raise
    except Exception as exc:  # lm-eval's and datasets' own (a data file not found, a task that does not load)
        raise OpenflashError(f"lm-eval could not run {names}: {type(exc).__name__}: {exc} (a task's data files "
                             f"are read relative to the working folder, as lm-eval reads them)") from exc
    if results is None:
        raise OpenflashError("lm-eval returned no results")
    results["config"] = {**{k: v for k, v in results.get("config", {}).items() if k != "model"},
                         "model": cfg.model, "lora": cfg.lora, "max_length": cfg.max_length}
    return results


def summary(results: dict[str, Any]) -> str:
    """The lines `openflash eval` prints: lm-eval's table, or the perplexity."""
    if "perplexity" in results:
        p = results["perplexity"]
        return (f"perplexity {p['perplexity']:.3f} ({p['nll_per_token']:.4f} nats a token) over {p['tokens']} tokens "
                f"of {p['documents']} documents ({p['split']} split of {p['data']})")
    from lm_eval.utils import make_table

    return make_table(results)


__all__ = ["EvalConfig", "run_eval", "summary", "task_sources"]
