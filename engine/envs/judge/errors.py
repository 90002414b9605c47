"""The judge's one error class, `judge` (stage `reward`), and what caused it (`kind`).

`kind` is the class of the transport failure that spent the judge's retries (`connection`, `server`,
`timeout`, `client`, `malformed`), or `unparseable` when the judge answered without a score. The
judge's statistics count failures by kind.
"""

from __future__ import annotations

from engine.errors import ErrorClass, Stage, TurnError

UNPARSEABLE = "unparseable"


class JudgeError(TurnError):
    """The judge gave no score for a conversation. `kind` says why (see the module docstring)."""

    stage = Stage.REWARD

    def __init__(self, kind: str, message: str):
        super().__init__(ErrorClass.JUDGE, message)
        self.kind = kind

    def as_data(self) -> dict[str, str]:
        return {"class": str(self.error_class), "kind": self.kind, "message": self.message}


class UnparseableScore(JudgeError):
    """The judge's reply holds no score on the rubric's scale."""

    def __init__(self, message: str):
        super().__init__(UNPARSEABLE, message)
