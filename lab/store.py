"""Lab runs in SQLite (<data>/lab.db): the run's provenance (model, settings with profile versions, prompt-set hash,
code version), every output as it finishes (so a cancelled run keeps what it had), and blind A/B votes."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any


from .runner import Output, cell_metrics

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
  id INTEGER PRIMARY KEY AUTOINCREMENT, created TEXT NOT NULL, model TEXT NOT NULL, prompt_set TEXT NOT NULL,
  prompt_set_hash TEXT NOT NULL, code_version TEXT NOT NULL, settings TEXT NOT NULL, prompts TEXT NOT NULL,
  seeds INTEGER NOT NULL, max_tokens INTEGER NOT NULL, status TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS outputs (
  run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE, cell INTEGER NOT NULL, prompt_id TEXT NOT NULL,
  seed INTEGER NOT NULL, data TEXT NOT NULL, PRIMARY KEY (run_id, cell, prompt_id, seed));
CREATE TABLE IF NOT EXISTS votes (
  run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE, prompt_id TEXT NOT NULL, seed INTEGER NOT NULL,
  cell_a INTEGER NOT NULL, cell_b INTEGER NOT NULL, a_on_left INTEGER NOT NULL, choice TEXT NOT NULL,
  created TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS judge_answers (
  key TEXT PRIMARY KEY, judge TEXT NOT NULL, rubric_version TEXT NOT NULL, answer TEXT NOT NULL, created TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS judgements (
  run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE, cell_a INTEGER NOT NULL, cell_b INTEGER NOT NULL,
  prompt_id TEXT NOT NULL, seed INTEGER NOT NULL, judge TEXT NOT NULL, rubric_version TEXT NOT NULL,
  data TEXT NOT NULL, PRIMARY KEY (run_id, cell_a, cell_b, prompt_id, seed, judge, rubric_version));
"""


class RunNotFound(ValueError):
    pass


def code_version() -> str:
    """The installed mlxchat version, plus the git commit when running from a checkout (an editable install)."""
    try:
        version = metadata.version("mlxchat")
    except metadata.PackageNotFoundError:
        version = "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                capture_output=True, text=True, timeout=5)
    except OSError:
        return version
    return f"{version}+{commit.stdout.strip()}" if commit.returncode == 0 else version


@dataclass
class Run:
    id: int
    created: str
    model: str
    prompt_set: str
    prompt_set_hash: str
    code_version: str
    settings: list[dict[str, Any]]  # {"label", "setting": {field: value}}
    prompts: dict[str, str]  # id -> text, in the set's order
    seeds: int
    max_tokens: int
    status: str  # running | done | cancelled | failed
    outputs: list[Output] = field(default_factory=list)

    def outputs_of(self, cell: int) -> list[Output]:
        return [o for o in self.outputs if o.cell == cell]

    def cells(self) -> list[dict[str, Any]]:
        return [{"label": s["label"], "setting": s["setting"], "metrics": cell_metrics(self.outputs_of(i)),
                 "outputs": [o.as_dict() for o in self.outputs_of(i)]} for i, s in enumerate(self.settings)]

    def as_json(self) -> dict[str, Any]:
        return {"run_id": self.id, "model": self.model, "prompt_set": self.prompt_set,
                "prompt_set_hash": self.prompt_set_hash, "code_version": self.code_version, "created": self.created,
                "status": self.status, "seeds": self.seeds, "max_tokens": self.max_tokens, "cells": self.cells()}


class LabStore:
    def __init__(self, path: Path | None = None) -> None:
        if path is None:
            from mlxchat.core.locations import data_dir  # here: importing mlxchat.core loads MLX

            path = data_dir() / "lab.db"
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # check_same_thread=False: the TUI runs experiments in a worker thread; each call is one short transaction.
        self.db = sqlite3.connect(self.path, check_same_thread=False)
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def create(self, *, model: str, prompt_set: str, prompt_set_hash: str, settings: list[dict[str, Any]],
               prompts: dict[str, str], seeds: int, max_tokens: int) -> int:
        with self.db:
            cur = self.db.execute(
                "INSERT INTO runs (created, model, prompt_set, prompt_set_hash, code_version, settings, prompts, "
                "seeds, max_tokens, status) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'running')",
                (datetime.now(timezone.utc).isoformat(timespec="seconds"), model, prompt_set, prompt_set_hash,
                 code_version(), json.dumps(settings), json.dumps(prompts), seeds, max_tokens))
        return int(cur.lastrowid)

    def add_output(self, run_id: int, output: Output) -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO outputs VALUES (?, ?, ?, ?, ?)",
                            (run_id, output.cell, output.prompt_id, output.seed, json.dumps(output.as_dict())))

    def finish(self, run_id: int, status: str) -> None:
        with self.db:
            self.db.execute("UPDATE runs SET status = ? WHERE id = ?", (status, run_id))

    def add_vote(self, run_id: int, prompt_id: str, seed: int, cell_a: int, cell_b: int, a_on_left: bool,
                 choice: str) -> None:
        with self.db:
            self.db.execute("INSERT INTO votes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            (run_id, prompt_id, seed, cell_a, cell_b, int(a_on_left), choice,
                             datetime.now(timezone.utc).isoformat(timespec="seconds")))

    def votes(self, run_id: int) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT prompt_id, seed, cell_a, cell_b, a_on_left, choice FROM votes "
                               "WHERE run_id = ? ORDER BY rowid", (run_id,)).fetchall()
        return [{"prompt_id": r[0], "seed": r[1], "cell_a": r[2], "cell_b": r[3], "a_on_left": bool(r[4]),
                 "choice": r[5]} for r in rows]

    # --- the judge (lab/judge.py): its raw answers by prompt, and each pair's verdict with the run ---------------

    def cached_answer(self, key: str) -> str | None:
        row = self.db.execute("SELECT answer FROM judge_answers WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def cache_answer(self, key: str, judge: str, rubric_version: str, answer: str) -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO judge_answers VALUES (?, ?, ?, ?, ?)",
                            (key, judge, rubric_version, answer,
                             datetime.now(timezone.utc).isoformat(timespec="seconds")))

    def add_judgement(self, run_id: int, cell_a: int, cell_b: int, prompt_id: str, seed: int, judge: str,
                      rubric_version: str, pair: dict[str, Any]) -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO judgements VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            (run_id, cell_a, cell_b, prompt_id, seed, judge, rubric_version, json.dumps(pair)))

    def judgements(self, run_id: int) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT cell_a, cell_b, prompt_id, seed, judge, rubric_version, data FROM judgements "
                               "WHERE run_id = ? ORDER BY rowid", (run_id,)).fetchall()
        return [{"cell_a": r[0], "cell_b": r[1], "prompt_id": r[2], "seed": r[3], "judge": r[4],
                 "rubric_version": r[5], "verdict": json.loads(r[6])["verdict"]} for r in rows]

    def list(self) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT r.id, r.created, r.model, r.prompt_set, r.settings, r.status, "
            "(SELECT COUNT(*) FROM outputs o WHERE o.run_id = r.id) FROM runs r ORDER BY r.id").fetchall()
        return [{"id": r[0], "created": r[1], "model": r[2], "prompt_set": r[3],
                 "settings": [s["label"] for s in json.loads(r[4])], "status": r[5], "outputs": r[6]} for r in rows]

    def resolve(self, ref: str) -> int:
        """A run id, or "last" for the newest run."""
        if ref == "last":
            row = self.db.execute("SELECT MAX(id) FROM runs").fetchone()
            if row[0] is None:
                raise RunNotFound(f"no lab runs yet in {self.path}; start one with `mlxchat lab run`")
            return int(row[0])
        if not ref.isdigit():
            raise RunNotFound(f"{ref!r} is not a run id; see `mlxchat lab list` (or use 'last')")
        return int(ref)

    def load(self, ref: str | int) -> Run:
        run_id = ref if isinstance(ref, int) else self.resolve(ref)
        row = self.db.execute("SELECT id, created, model, prompt_set, prompt_set_hash, code_version, settings, prompts,"
                              " seeds, max_tokens, status FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise RunNotFound(f"no lab run {run_id} in {self.path}; see `mlxchat lab list`")
        run = Run(*row[:6], json.loads(row[6]), json.loads(row[7]), *row[8:])
        order = {pid: i for i, pid in enumerate(run.prompts)}
        outs = [Output(**json.loads(d)) for (d,) in
                self.db.execute("SELECT data FROM outputs WHERE run_id = ?", (run_id,)).fetchall()]
        run.outputs = sorted(outs, key=lambda o: (o.cell, order.get(o.prompt_id, 0), o.seed))
        return run
