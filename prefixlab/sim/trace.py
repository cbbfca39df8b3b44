"""The request record every trace format parses into and the simulator replays."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class Request:
    """One request: the full input (history included) and the tokens the model produced for it.

    Tokens are int64 numpy arrays. `ts` is the arrival time in seconds.
    """

    session_id: str
    turn_id: int
    ts: float
    input_tokens: np.ndarray
    output_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def tokens(self) -> np.ndarray:
        """Input followed by output: what the next turn of this session can resume from."""
        return np.concatenate([self.input_tokens, self.output_tokens])
