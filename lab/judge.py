"""LLM-as-a-judge over a stored run: pairwise verdicts between two settings' outputs of the same prompt and seed.

Each pair is asked in both orders (the judge sees A's output first, then B's first), since judges favour a position
(Zheng et al. 2023, "Judging LLM-as-a-judge with MT-Bench"). A setting wins a pair only when both orders name it; a
split or a tie in either order is a tie. An answer that names no verdict is kept as "unparsed", never guessed; a pair
with one parsed order takes that order's verdict. The rubric is per prompt set (templates/rubrics/NAME.toml, a
user's <config>/rubrics/NAME.toml, or --rubric FILE) and versioned. Every answer is cached by the judge's prompt
(which holds both outputs and the rubric), the judge and the rubric's version, so a rerun asks the judge nothing.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from . import metrics as M
from .store import LabStore, Run

if TYPE_CHECKING:
    from mlxchat.core import Engine

BUILTIN_DIR = importlib.resources.files("mlxchat.templates") / "rubrics"
VERDICTS = ("a", "b", "tie")

PROMPT = """You compare two replies to the same request and say which is better.

Criteria:{criteria}

[Request]
{request}

[Reply A]
{first}

[Reply B]
{second}

Which reply is better by the criteria? Answer with exactly one word: A, B, or TIE. Do not explain."""

# The verdict is the answer's first word, after an optional "Verdict:" and markdown or brackets ("**A**", "[[B]]",
# "Reply A is better"), ending the line or followed by punctuation or "is"/"wins". A and B must be capitals and
# stand alone: "a tie", "A better reply is B" and the options echoed back name no verdict.
_ANSWER = re.compile(r"^[\s*_`\"'\[(]*(?:(?i:final\s+)?(?i:verdict|answer|winner|choice|better)\s*(?i:is)?\s*[:=\-]?"
                     r"[\s*_`\"'\[(]*)?(?:(?i:reply|response|output)\s+)?(A|B|(?i:tie))"
                     r"(?!\s*(?:,|/|(?i:or))\s*(?:A|B|(?i:tie))\b)"  # the options echoed ("A, B, or TIE")
                     r"(?=\s*$|[ \t]*[\n.,;:!?)\]*_`\"'(-]|\s+(?i:is|wins|was)\b)")


class RubricError(ValueError):
    """A rubric file is missing or malformed; the message is one line naming the file and the fix."""


@dataclass(frozen=True)
class Rubric:
    name: str
    version: int
    criteria: str
    digest: str  # of the file: an edit without a new version still gets fresh verdicts

    @property
    def tag(self) -> str:
        return f"{self.name} v{self.version} ({self.digest[:8]})"


def rubric_dir() -> Path:
    from mlxchat.core.locations import config_dir  # here: importing mlxchat.core loads MLX

    return config_dir() / "rubrics"


def parse_rubric(name: str, raw: bytes, source: str) -> Rubric:
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise RubricError(f"{source}: not valid TOML ({e})") from None
    version, criteria = data.get("version"), data.get("criteria")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise RubricError(f"{source}: needs version = N (a whole number of at least 1)")
    if not isinstance(criteria, str) or not criteria.strip():
        raise RubricError(f"{source}: needs criteria = \"\"\"what makes a reply better\"\"\"")
    return Rubric(name, version, criteria.rstrip(), hashlib.sha256(raw).hexdigest())


def load_rubric(prompt_set: str, path: Path | None = None) -> Rubric:
    """--rubric FILE, else the user's rubric for the prompt set, else the shipped one, else the default rubric."""
    if path is not None:
        if not path.is_file():
            raise RubricError(f"--rubric {path}: no such file")
        return parse_rubric(path.stem, path.read_bytes(), str(path))
    user = rubric_dir() / f"{prompt_set}.toml"
    if user.is_file():
        return parse_rubric(prompt_set, user.read_bytes(), str(user))
    shipped = BUILTIN_DIR / f"{prompt_set}.toml"
    if shipped.is_file():
        return parse_rubric(prompt_set, shipped.read_bytes(), str(shipped))
    return parse_rubric("default", (BUILTIN_DIR / "default.toml").read_bytes(), "default.toml")


def parse_verdict(answer: str) -> str | None:
    """"A", "B" or "tie" (as shown to the judge) from its answer; None when the answer names none."""
    m = _ANSWER.match(answer)
    return None if m is None else m[1] if m[1] in ("A", "B") else "tie"


# --- judges --------------------------------------------------------------------------------------------------------

class Judge(Protocol):
    name: str

    def ask(self, prompt: str) -> str: ...

    def close(self) -> None: ...


class EngineJudge:
    """A model mlxchat loads, greedy; loaded only when an answer is not cached."""

    def __init__(self, name: str, load: Callable[[], "Engine"], max_tokens: int) -> None:
        self.name = f"{name} (local, max {max_tokens} tok)"
        self.load, self.max_tokens = load, max_tokens
        self.engine: Engine | None = None

    def ask(self, prompt: str) -> str:
        from mlxchat.core import SamplingProfile

        if self.engine is None:
            self.engine = self.load()
        return self.engine.generate(prompt, profile=SamplingProfile(temperature=0, seed=0),
                                    max_tokens=self.max_tokens).text

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


class EndpointJudge:
    """Any OpenAI-compatible endpoint, at temperature 0 and seed 0."""

    def __init__(self, endpoint: Any, model: str, max_tokens: int) -> None:  # endpoint: lab.endpoint.Endpoint
        self.endpoint, self.model, self.max_tokens = endpoint, model, max_tokens
        self.name = f"{model} at {endpoint.base} (max {max_tokens} tok)"

    def ask(self, prompt: str) -> str:
        body = {"temperature": 0, "seed": 0, "max_tokens": self.max_tokens}
        return self.endpoint.chat(self.model, [{"role": "user", "content": prompt}], body).text

    def close(self) -> None:
        self.endpoint.close()


# --- judging a run -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PairJob:
    prompt_id: str
    seed: int
    request: str
    a: str
    b: str


def pair_jobs(run: Run, cell_a: int, cell_b: int) -> list[PairJob]:
    """The outputs of both settings with the same prompt and seed, in the run's order."""
    b = {(o.prompt_id, o.seed): o.text for o in run.outputs_of(cell_b)}
    return [PairJob(o.prompt_id, o.seed, run.prompts.get(o.prompt_id, ""), o.text, b[(o.prompt_id, o.seed)])
            for o in run.outputs_of(cell_a) if (o.prompt_id, o.seed) in b]


def combine(orders: list[dict[str, Any]]) -> str:
    """The pair's verdict in setting terms from its orders' verdicts (each "a", "b", "tie" or "unparsed")."""
    parsed = [o["verdict"] for o in orders if o["verdict"] != "unparsed"]
    if not parsed:
        return "unparsed"
    return parsed[0] if len(set(parsed)) == 1 else "tie"


class Judging:
    """Judges the pairs of two settings of a stored run, caching every answer in the lab store."""

    def __init__(self, store: LabStore, run: Run, cell_a: int, cell_b: int, judge: Judge, rubric: Rubric) -> None:
        self.store, self.run, self.cell_a, self.cell_b = store, run, cell_a, cell_b
        self.judge, self.rubric = judge, rubric
        self.asked = 0  # answers the judge gave in this session (not from the cache)

    def _answer(self, prompt: str) -> tuple[str, bool]:
        key = hashlib.sha256(json.dumps([self.judge.name, self.rubric.tag, prompt]).encode()).hexdigest()
        cached = self.store.cached_answer(key)
        if cached is not None:
            return cached, True
        answer = self.judge.ask(prompt)
        self.asked += 1
        self.store.cache_answer(key, self.judge.name, self.rubric.tag, answer)
        return answer, False

    def judge_pair(self, job: PairJob) -> dict[str, Any]:
        """Both orders of one pair; the pair's verdict is stored with the run at once (a stop keeps it)."""
        orders = []
        for first in ("a", "b"):  # the same pair both ways round
            shown = (job.a, job.b) if first == "a" else (job.b, job.a)
            prompt = PROMPT.format(criteria="\n" + self.rubric.criteria.strip("\n"), request=job.request,
                                   first=shown[0].strip() or "(empty)", second=shown[1].strip() or "(empty)")
            answer, cached = self._answer(prompt)
            said = parse_verdict(answer)
            verdict = "unparsed" if said is None else "tie" if said == "tie" else \
                (first if said == "A" else ("b" if first == "a" else "a"))
            orders.append({"first": first, "answer": answer, "parsed": said, "verdict": verdict, "cached": cached})
        # The outputs' lengths in words, for the length-controlled win rate (a judge may favour the longer answer).
        pair = {"prompt_id": job.prompt_id, "seed": job.seed, "verdict": combine(orders), "orders": orders,
                "words_a": len(M.words(job.a)), "words_b": len(M.words(job.b))}
        self.store.add_judgement(self.run.id, self.cell_a, self.cell_b, job.prompt_id, job.seed, self.judge.name,
                                 self.rubric.tag, pair)
        return pair


def summary(pairs: list[dict[str, Any]], judge: str, rubric: Rubric) -> dict[str, Any]:
    """The JSON of `lab judge`: counts, A's win rate (a tie is half a win) with a Wilson interval, every verdict."""
    count = {v: sum(p["verdict"] == v for p in pairs) for v in (*VERDICTS, "unparsed")}
    decided = count["a"] + count["b"] + count["tie"]
    est = M.wilson(count["a"] + 0.5 * count["tie"], decided)
    both = [p for p in pairs if all(o["verdict"] != "unparsed" for o in p["orders"])]
    consistent = sum(p["orders"][0]["verdict"] == p["orders"][1]["verdict"] for p in both)
    decided_pairs = [p for p in pairs if p["verdict"] != "unparsed"]
    scores = [{"a": 1.0, "b": 0.0, "tie": 0.5}[p["verdict"]] for p in decided_pairs]
    # Pairs judged before lengths were stored have none: then no length-controlled rate.
    diffs = ([p["words_a"] - p["words_b"] for p in decided_pairs]
             if all("words_a" in p for p in decided_pairs) else None)
    return {"pairs": len(pairs), "swapped": sum(len(p["orders"]) == 2 for p in pairs), "wins_a": count["a"],
            "wins_b": count["b"], "ties": count["tie"], "unparsed": count["unparsed"],
            "win_rate_a": est.as_dict() if est else None,
            # pairs whose two orders agree, of those where both parsed: 1 = no sign of position bias
            "consistent": consistent,
            # the judge's order-flip rate: of the pairs where both orders parsed, those whose verdict flipped with
            # the order (position bias); reported next to its verdicts, since a high one makes them noise
            "order_flip_rate": (len(both) - consistent) / len(both) if both else None, "both_parsed": len(both),
            **M.paired_comparison(scores, diffs),
            "judge": judge, "rubric_version": rubric.tag, "verdicts": pairs}


def cohen_kappa(pairs: list[tuple[str, str]]) -> dict[str, Any] | None:
    """Cohen's kappa between two raters' labels over the same items: (p_o - p_e) / (1 - p_e). None for no items;
    kappa None when chance agreement is 1 (both raters gave one and the same label throughout)."""
    n = len(pairs)
    if n == 0:
        return None
    labels = {x for p in pairs for x in p}
    p_o = sum(x == y for x, y in pairs) / n
    p_e = sum((sum(x == k for x, _ in pairs) / n) * (sum(y == k for _, y in pairs) / n) for k in labels)
    return {"kappa": None if p_e == 1 else (p_o - p_e) / (1 - p_e), "agreement": p_o, "n": n}


def agreement(judgements: list[dict[str, Any]], votes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (setting pair, judge, rubric): Cohen's kappa between the judge's verdicts and the blind A/B votes on the
    same (prompt, seed), whichever setting each called A. A pair's last vote counts; skipped votes and unparsed
    verdicts are left out."""
    from .ab import winner

    def oriented(cell_a: int, cell_b: int, verdict: str) -> tuple[int, int, str]:
        """The same pair of settings in one order (lower cell first), whichever was --a: "a" means the lower."""
        if cell_a < cell_b:
            return cell_a, cell_b, verdict
        return cell_b, cell_a, {"a": "b", "b": "a"}.get(verdict, verdict)

    human: dict[tuple[int, int, str, int], str] = {}
    for v in votes:
        lo, hi, w = oriented(v["cell_a"], v["cell_b"], winner(v["choice"], v["a_on_left"]))
        if w != "skip":
            human[(lo, hi, v["prompt_id"], v["seed"])] = w
    groups: dict[tuple[int, int, str, str], list[tuple[str, str]]] = {}
    for j in judgements:
        lo, hi, verdict = oriented(j["cell_a"], j["cell_b"], j["verdict"])
        key = (lo, hi, j["prompt_id"], j["seed"])
        if key in human and verdict != "unparsed":
            groups.setdefault((lo, hi, j["judge"], j["rubric_version"]), []).append((verdict, human[key]))
    return [{"cell_a": a, "cell_b": b, "judge": judge, "rubric_version": rubric, **cohen_kappa(items)}
            for (a, b, judge, rubric), items in groups.items()]
