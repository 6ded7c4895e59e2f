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

:class:`ChatWorkload` is the same replay in text (``--workload sharegpt``): each client
one recorded conversation (ShareGPT's, read by :mod:`hicache.cli.benchmarks.serve_chat`),
its human turns sent in order as chat messages; a later turn's messages are the earlier
human turns with the server's own replies as assistant messages (or, with
``recorded_replies``, the conversation's recorded replies: every configuration then gets
the same prompts). The server renders them with the model's chat template; the prompt's
token ids come back with the reply.

Both shapes give the load driver a :class:`Turn` per request: :meth:`first_turn`,
then :meth:`next_turn` with the reply, until the conversation's last round.

This module knows nothing of HTTP or vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Turn:
    """One request of a conversation: token ids (``/v1/completions``, ``max_tokens``
    generated whatever the model says: ``ignore_eos``), or chat ``messages``
    (``/v1/chat/completions``, up to ``max_tokens``, ending on the model's EOS)."""

    prompt: list[int]
    messages: list[dict[str, str]] | None = None


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

    def first_turn(self, client: int, conversation: int = 0) -> Turn:
        return Turn(self.first_prompt(client, conversation))

    def next_turn(self, client: int, conversation: int, round_no: int, previous: Turn,
                  reply: list[int], reply_text: str) -> Turn:
        return Turn(self.next_prompt(previous.prompt, reply, client, conversation, round_no))


class Conversation(Protocol):
    """A recorded chat (:class:`hicache.realdata.Chat`): human turns, recorded replies."""

    @property
    def human(self) -> tuple[str, ...]: ...
    @property
    def gpt(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class ChatWorkload:
    """Recorded conversations replayed as chats, one per client, ``num_rounds`` human
    turns each (every conversation has at least that many; with ``recorded_replies``,
    a recorded reply to each of them but the last). ``max_seq_tokens`` bounds the
    longest prompt and its reply in the model's tokens (its caller counts them);
    ``vocab_size`` is the model's, for the token-id warm-up and no-hit prompts."""

    chats: Sequence[Conversation]
    num_rounds: int
    max_tokens: int
    max_seq_tokens: int
    vocab_size: int
    recorded_replies: bool = False
    working_set_tokens: int = 0  # every conversation's longest sequence, summed (0: unknown)

    def __post_init__(self) -> None:
        for name in ("num_rounds", "max_tokens", "max_seq_tokens", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)}")
        if not self.chats:
            raise ValueError("chats: expected at least one conversation")
        need_replies = self.num_rounds - 1 if self.recorded_replies else 0
        for i, chat in enumerate(self.chats):
            if len(chat.human) < self.num_rounds or len(chat.gpt) < need_replies:
                raise ValueError(f"chats[{i}]: expected {self.num_rounds} human turns"
                                 f"{f' and {need_replies} replies' if need_replies else ''}, "
                                 f"got {len(chat.human)} and {len(chat.gpt)}")

    @property
    def num_clients(self) -> int:
        return len(self.chats)

    @property
    def num_requests(self) -> int:
        return self.num_clients * self.num_rounds

    def _chat(self, client: int, conversation: int) -> Conversation:
        # A soak's next conversation of a client: the next chat along, round the list.
        return self.chats[(client + conversation * self.num_clients) % len(self.chats)]

    def first_turn(self, client: int, conversation: int = 0) -> Turn:
        text = self._chat(client, conversation).human[0]
        return Turn([], [{"role": "user", "content": text}])

    def next_turn(self, client: int, conversation: int, round_no: int, previous: Turn,
                  reply: list[int], reply_text: str) -> Turn:
        """Round ``round_no`` (>= 1): the previous messages, the reply (the server's,
        or the recorded one), the next human turn."""
        chat = self._chat(client, conversation)
        answer = chat.gpt[round_no - 1] if self.recorded_replies else reply_text
        return Turn([], [*(previous.messages or []), {"role": "assistant", "content": answer},
                         {"role": "user", "content": chat.human[round_no]}])


class AnyWorkload(Protocol):
    """What the load driver needs of a workload."""

    @property
    def num_clients(self) -> int: ...
    @property
    def num_rounds(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_seq_tokens(self) -> int: ...
    @property
    def num_requests(self) -> int: ...

    def first_turn(self, client: int, conversation: int = 0) -> Turn: ...

    def next_turn(self, client: int, conversation: int, round_no: int, previous: Turn,
                  reply: list[int], reply_text: str) -> Turn: ...


def unique_prompts(num_requests: int, prompt_tokens: int, max_tokens: int, vocab_size: int,
                   seed: int = 0) -> Workload:
    """``num_requests`` prompts of ``prompt_tokens`` random tokens sharing nothing."""
    return Workload(num_clients=num_requests, num_rounds=1, num_system_prompts=0,
                    system_tokens=0, first_tokens=prompt_tokens, turn_tokens=0,
                    max_tokens=max_tokens, vocab_size=vocab_size, seed=seed + 1_000_003)
