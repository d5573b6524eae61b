"""Benchmark workloads: which prompts, rendered how.

Three axes, as in the EAGLE-3.1 paper:
  standard    the EAGLE eval subsets (MT-bench answered turn by turn, GSM8K, HumanEval, Alpaca, QA,
              summarisation), chat template with the target's default system prompt;
  templates   the same MT-bench questions under perturbed templates: an empty system prompt, three
              different system prompts, and a plain-text "User:/Assistant:" format without the chat
              template ("tpl-default" is the unperturbed reference);
  long        essays (../shared/data/long_context) cut to about 1k, 2k, 4k and 8k tokens, followed by a
              summarise or answer-a-question task.

A Prompt is data only; `encode` turns it (plus the answers of earlier turns) into token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..data.chat import prompt_ids
from ..data.readers import jsonl_rows
from ..errors import AnchorspecError

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"

STANDARD = ("mt_bench", "gsm8k", "humaneval", "alpaca", "qa", "sum")
SYSTEM_PROMPTS = {
    "tpl-default": None,  # no system message: the template's own default (SmolLM2 inserts one)
    "tpl-empty-system": "",
    "tpl-sys-concise": "You are a concise assistant. Answer briefly and precisely, without preamble.",
    "tpl-sys-pirate": "You are a pirate captain. Always answer in the voice of a pirate.",
    "tpl-sys-expert": "You are a world-class expert consultant. Reason step by step and explain your answer "
                      "in detail, with examples.",
}
TEMPLATES = tuple(SYSTEM_PROMPTS) + ("tpl-plain",)
LONG_SIZES = {"long-1k": 1000, "long-2k": 2000, "long-4k": 4000, "long-8k": 8000}
LONG = tuple(LONG_SIZES)
GROUPS = {"standard": STANDARD, "templates": TEMPLATES, "long": LONG}
LONG_TASKS = ("Summarize the text above in five sentences.",
              "What is the main argument of the text above? Answer in a short paragraph.")


@dataclass(frozen=True)
class Prompt:
    workload: str
    id: str
    turns: tuple[str, ...]  # user turns; later turns follow the model's answers to earlier ones
    system: str | None = None  # None: no system message (the template decides)
    plain: bool = False  # plain "User:/Assistant:" text instead of the chat template


def group_of(workload: str) -> str:
    for group, names in GROUPS.items():
        if workload in names:
            return group
    raise AnchorspecError(f"unknown workload {workload!r}")


def expand_workloads(spec: str) -> list[str]:
    """'standard,long-2k,tpl-plain' -> workload names (groups expand to their members, order kept)."""
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        members = GROUPS.get(part, (part,))
        for name in members:
            group_of(name)  # raises for unknown names
            if name not in names:
                names.append(name)
    if not names:
        raise AnchorspecError("no workloads given (groups: standard, templates, long; or single names)")
    return names


def _questions(data_dir: Path, subset: str) -> list[dict]:
    path = data_dir / "eagle_eval" / subset / "question.jsonl"
    if not path.is_file():
        raise AnchorspecError(f"{path} does not exist "
                              "(pass --data-dir: the folder holding eagle_eval/ and long_context/)")
    rows = [row for _, row in jsonl_rows(path)]
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("turns"), list) and r["turns"]]


def _essay_text(data_dir: Path) -> list[str]:
    folder = data_dir / "long_context" / "paul_graham_essays"
    files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
    if not files:
        raise AnchorspecError(f"no essays in {folder} (pass --data-dir)")
    return [f.read_text() for f in files]


def _long_prompts(name: str, size: int, essays: list[str], tokenizer, limit: int) -> list[Prompt]:
    """Item i starts at essay i and runs on through the following essays; it is cut to `size` tokens and
    then back to the last line break (the task sentence comes after)."""
    out = []
    for i in range(min(limit, len(essays))):
        text, j = "", i
        while len(text) < size * 8 and j < i + len(essays):  # ~4 chars per token: plenty, then cut
            text += essays[j % len(essays)].strip() + "\n\n"
            j += 1
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:size]
        cut = tokenizer.decode(ids)
        cut = cut[: cut.rfind("\n")] if "\n" in cut else cut
        out.append(Prompt(name, f"{name}-{i}", (f"{cut.strip()}\n\n{LONG_TASKS[i % len(LONG_TASKS)]}",)))
    return out


def load_workload(name: str, limit: int, tokenizer=None, data_dir: str | Path | None = None,
                  context: int | None = None, max_new_tokens: int = 0) -> list[Prompt]:
    """The first `limit` prompts of a workload. Long-context sizes are capped so that prompt plus
    `max_new_tokens` fit the target's `context`."""
    if limit < 1:
        raise AnchorspecError(f"--limit must be >= 1, got {limit}")
    data_dir = Path(data_dir) if data_dir else DEFAULT_DATA_DIR
    group = group_of(name)
    if group == "standard":
        rows = _questions(data_dir, name)[:limit]
        turns = (lambda r: tuple(r["turns"])) if name == "mt_bench" else (lambda r: (r["turns"][0],))
        return [Prompt(name, f"{name}-{r.get('question_id', k)}", turns(r)) for k, r in enumerate(rows)]
    if group == "templates":
        rows = _questions(data_dir, "mt_bench")[:limit]
        return [Prompt(name, f"{name}-{r.get('question_id', k)}", (r["turns"][0],),
                       system=SYSTEM_PROMPTS.get(name), plain=name == "tpl-plain") for k, r in enumerate(rows)]
    if tokenizer is None:
        raise AnchorspecError("long-context workloads need the target's tokenizer")
    size = LONG_SIZES[name]
    if context:
        size = min(size, context - max_new_tokens - 96)  # room for the template and the task sentence
        if size < 256:
            raise AnchorspecError(f"{name}: the target's context ({context}) is too short")
    return _long_prompts(name, size, _essay_text(data_dir), tokenizer, limit)


def encode(tokenizer, prompt: Prompt, answers: list[str]) -> list[int]:
    """Token ids for the next turn: user turns 0..len(answers), with the given answers in between."""
    if len(answers) >= len(prompt.turns):
        raise AnchorspecError(f"{prompt.id}: {len(answers)} answers for {len(prompt.turns)} turns")
    turns = prompt.turns[: len(answers) + 1]
    if prompt.plain:
        lines = [prompt.system] if prompt.system else []
        for k, user in enumerate(turns):
            lines.append(f"User: {user}")
            lines.append(f"Assistant: {answers[k]}" if k < len(answers) else "Assistant:")
        return tokenizer("\n".join(lines), add_special_tokens=True)["input_ids"]
    messages = [{"role": "system", "content": prompt.system}] if prompt.system is not None else []
    for k, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        if k < len(answers):
            messages.append({"role": "assistant", "content": answers[k]})
    return prompt_ids(tokenizer, messages)
