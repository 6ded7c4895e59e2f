"""The conversations of ``hicache bench serve``: many clients, many rounds, shared system prompts.

A client holds one conversation at a time. Its first turn is a shared system prompt
(one of ``num_system_prompts``, by client number) followed by the client's task; each
later turn's prompt is the previous prompt, the reply the server gave, and the next
user text (a tool result, in the agentic shape of docs/workloads.md)::

    round 0:  [ system s ][ task          ]
    round 1:  [ system s ][ task          ][ reply 0 ][ user 1 ]
    round 2:  [ system s ][ task          ][ reply 0 ][ user 1 ][ reply 1 ][ user 2 ]

so a cache that kept a client's previous turn serves all of the next prompt but its
last reply and user text. The user texts are token ids drawn from a seed and the
(client, conversation, round) they belong to: two runs of one workload send the same
prompts wherever the server gave the same replies. :func:`unique_prompts` is the
opposite shape: one round per client, no system prompt, nothing shared (a cache can
only cost there).

This module knows nothing of HTTP or vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Workload:
    """Sizes of the conversations; prompts are built on demand (:meth:`first_prompt`,
    :meth:`next_prompt`)."""

    num_clients: int
    num_rounds: int  # turns per conversation
    num_system_prompts: int  # 0: no system prompt
    system_tokens: int
    first_tokens: int  # the task, after the system prompt
    turn_tokens: int  # user text of every later round
    max_tokens: int  # generated per turn
    vocab_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_clients", "num_rounds", "first_tokens", "max_tokens", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)}")
        for name in ("num_system_prompts", "system_tokens", "turn_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {getattr(self, name)}")
        if self.num_rounds > 1 and self.turn_tokens < 1:
            raise ValueError(f"turn_tokens: expected >= 1 with {self.num_rounds} rounds, got 0")

    @property
    def num_requests(self) -> int:
        """Requests of one conversation per client."""
        return self.num_clients * self.num_rounds

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt (the last round's)."""
        system = self.system_tokens if self.num_system_prompts else 0
        return (system + self.first_tokens
                + (self.num_rounds - 1) * (self.max_tokens + self.turn_tokens))

    @property
    def max_seq_tokens(self) -> int:
        """The longest sequence: the longest prompt and its reply."""
        return self.max_prompt_tokens + self.max_tokens

    def _tokens(self, n: int, *key: int) -> list[int]:
        rng = np.random.default_rng([self.seed, *key])
        # 1..vocab-1: token 0 is often a special token of a real vocabulary.
        return rng.integers(1, self.vocab_size, n).tolist()

    def system_prompt(self, index: int) -> list[int]:
        return self._tokens(self.system_tokens, 0, index)

    def first_prompt(self, client: int, conversation: int = 0) -> list[int]:
        """Round 0 of ``client``'s ``conversation``: its system prompt and task."""
        system = (self.system_prompt(client % self.num_system_prompts)
                  if self.num_system_prompts else [])
        return system + self._tokens(self.first_tokens, 1, client, conversation, 0)

    def next_prompt(self, previous_prompt: list[int], reply: list[int], client: int,
                    conversation: int, round_no: int) -> list[int]:
        """Round ``round_no`` (>= 1): the previous prompt, its reply, the next user text."""
        return (previous_prompt + reply
                + self._tokens(self.turn_tokens, 1, client, conversation, round_no))


def unique_prompts(num_requests: int, prompt_tokens: int, max_tokens: int, vocab_size: int,
                   seed: int = 0) -> Workload:
    """``num_requests`` prompts of ``prompt_tokens`` random tokens sharing nothing."""
    return Workload(num_clients=num_requests, num_rounds=1, num_system_prompts=0,
                    system_tokens=0, first_tokens=prompt_tokens, turn_tokens=0,
                    max_tokens=max_tokens, vocab_size=vocab_size, seed=seed + 1_000_003)
