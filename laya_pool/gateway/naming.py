"""Which checkpoint a request names, and the `routing` block its answer carries.

`laya serve` routes each request between the SDK's checkpoints (`english`, `multilingual`, `typed-decisions`) by its
`model` or `task` field, else by language detection, and reports the decision as `routing`. A pool serves one
checkpoint, which the gateway knows by one name (`--model-name`, default `english`). Its rules, on `laya serve`'s:

- no `model`, a Jev id such as `jev-1`, or the bundle id `convaiinnovations/laya`: the pool's checkpoint;
- the name, one of its aliases (`en`, `laya`, ...) or its published Hub id: the pool's checkpoint, reported as an
  explicit choice (`reason` "explicit model='english'", as `laya serve` words it);
- a path or an unpublished Hub id (a slash, a backslash, a leading `.` or `~`), or the name of an SDK checkpoint the
  pool does not serve: 422, rather than an answer from another checkpoint than the one asked for;
- `task` (when no `model`): as `model`, but an unknown one is always a 422 (`laya serve` resolves it the same way).

The routing block has `laya serve`'s keys; `repo`, `detection` and `workflow` are null: the gateway detects no language
and no workflow, since there is nothing to choose between. The SDK's tables are copied here (the gateway does not
import the SDK); tests/test_gateway_units.py holds them equal to `laya.router`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .limits import Refusal

BUNDLE_REPO = "convaiinnovations/laya"
SDK_CHECKPOINTS = ("english", "multilingual", "typed-decisions")
ALIASES = {
    "en": "english", "laya": "english", "default": "english",
    "multi": "multilingual", "ml": "multilingual", "laya-multilingual": "multilingual",
    "typed": "typed-decisions", "typed_decisions": "typed-decisions",
    "laya-typed-decisions": "typed-decisions", "decisions": "typed-decisions",
}
# Published Hub ids a client may send as `model`, lower-cased -> checkpoint (the bundle id is absent: it auto-routes).
PUBLISHED = {"convaiinnovations/laya-multilingual": "multilingual",
             "convaiinnovations/laya-typed-decisions": "typed-decisions"}
AUTO_REASON = "the pool serves one checkpoint"


def canonical(name: Any) -> str:
    """Trimmed, lower-cased, an alias resolved (the SDK's `canonical_name`)."""
    key = str(name).strip().lower()
    return ALIASES.get(key, key)


def names_a_source(text: str) -> bool:
    """Whether `text` is a filesystem path or a Hub repo id rather than a checkpoint name."""
    return bool(text) and (text[0] in ".~" or "/" in text or "\\" in text)


@dataclass(frozen=True)
class Checkpoint:
    """The pool's one checkpoint, as requests name it."""
    name: str = "english"

    def resolve(self, name: Any) -> str:
        """`name` if it means this checkpoint, else ValueError worded as the SDK's `Router.resolve`."""
        if canonical(name) == self.name:
            return self.name
        raise ValueError(f"unknown model {name!r}; choose one of {[self.name]!r} (or an alias: {sorted(ALIASES)!r})")

    def routing(self, reason: str = AUTO_REASON) -> dict[str, Any]:
        return {"model": self.name, "repo": None, "reason": reason, "detection": None, "workflow": None}

    def route(self, model: Any, task: Any) -> dict[str, Any]:
        """The routing block for a request's `model` and `task` fields, or a 422 Refusal."""
        named = self._model(model)
        if named is not None:
            return self.routing(f"explicit model={named!r}")
        if task is not None:
            wanted = "typed-decisions" if str(task).lower().replace("-", "_") == "typed_decisions" else task
            try:
                self.resolve(wanted)
            except ValueError as e:
                raise Refusal(422, str(e)) from None
            return self.routing(f"explicit task={task!r}")
        return self.routing()

    def _model(self, model: Any) -> str | None:
        """The checkpoint `model` pins (this one), None to answer unpinned, or a 422 Refusal."""
        if not model:
            return None
        text = str(model).strip()
        wanted = PUBLISHED.get(text.lower())
        if text.lower() == BUNDLE_REPO:
            return None
        try:
            return self.resolve(model if wanted is None else wanted)
        except ValueError as e:
            if wanted is not None or names_a_source(text) or canonical(model) in SDK_CHECKPOINTS:
                raise Refusal(422, f"{e}, or omit model to let the router choose") from None
            return None
