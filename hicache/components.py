"""Layer kinds of a hybrid model, as the cache sees them: components beside full attention.

A hybrid model mixes full-attention layers with sliding-window attention layers
(Gemma, gpt-oss, Mistral-style) or recurrent layers (Mamba, linear attention:
Qwen3-Next, Jamba, Granite 4). The cache keeps one radix tree; every node holds
the full-attention pages of its tokens (as for a single-kind model) and, per
*component*, what a hit at a prefix needs of the other layers::

    kind    a hit ending at token L needs                      a node keeps
    full    KV of every token before L                         every page (as ever)
    window  KV of the W - 1 tokens before L (window W)          all its pages or none
    state   the recurrent state after exactly L tokens         one checkpoint at its end or none

Pages of every kind live in one page space per tier (one allocator, one pool):
a page id holds ``page_size`` tokens of one *group* of layers, a group being as
many layers as the model has full-attention layers (vLLM's hybrid allocator
lays out its blocks the same way). A component whose layers make ``width``
groups needs ``width`` page ids per token page (window) or per checkpoint
(state). This module only describes components; the tree (:mod:`hicache.tree`)
keeps their pages, :mod:`hicache.config` lays them out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

# Largest width (page ids per token page) a component may have: far above any model
# (vLLM splits a layer kind into groups of the full-attention layer count).
MAX_COMPONENT_WIDTH = 1 << 16
# Largest window: far above any model's, and small enough for int64 arithmetic.
MAX_WINDOW_TOKENS = 1 << 40


class ComponentKind(str, Enum):
    """What a component keeps per node (see the module docstring)."""

    WINDOW = "window"  # sliding-window attention: the pages of the window before a hit
    STATE = "state"  # recurrent state (Mamba, linear attention): a checkpoint at a node's end


@dataclass(frozen=True)
class ComponentSpec:
    """One component: its kind, its window (``window`` kind) and its width in page ids.

    ``window_tokens`` is W: a token attends to itself and the ``W - 1`` tokens
    before it, so a hit at token ``L`` reads ``[L - W + 1, L)``: the
    ``window_pages(page_size) = ceil((W - 1) / page_size)`` pages before ``L``
    (vLLM's ``cdiv(sliding_window - 1, block_size)``). ``width``: page ids per
    token page (window) or per checkpoint (state), one per group of layers.
    """

    kind: ComponentKind | str
    window_tokens: int = 0  # window only: W >= 2 (W = 1 needs no cache)
    width: int = 1  # page ids per token page (window) or per checkpoint (state)

    def __post_init__(self) -> None:
        try:
            kind = ComponentKind(self.kind)
        except ValueError:
            kinds = [k.value for k in ComponentKind]
            raise ValueError(f"kind: expected one of {kinds}, got {self.kind!r}") from None
        object.__setattr__(self, "kind", kind)
        for name, value, low, high in (
            ("width", self.width, 1, MAX_COMPONENT_WIDTH),
            ("window_tokens", self.window_tokens, 0, MAX_WINDOW_TOKENS),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected int, got {type(value).__name__}")
            if not low <= value <= high:
                raise ValueError(f"{name}: expected an int in [{low}, {high}], got {value}")
        if kind is ComponentKind.WINDOW and self.window_tokens < 2:
            raise ValueError(
                f"window_tokens: a window component needs a window of >= 2 tokens, got "
                f"{self.window_tokens}"
            )
        if kind is ComponentKind.STATE and self.window_tokens:
            raise ValueError(
                f"window_tokens: a state component has no window, got {self.window_tokens}"
            )

    @property
    def is_window(self) -> bool:
        return self.kind is ComponentKind.WINDOW

    def window_pages(self, page_size: int) -> int:
        """Pages a hit reads before its first computed token (0 for a state component)."""
        if self.kind is not ComponentKind.WINDOW:
            return 0
        return -(-(self.window_tokens - 1) // page_size)

    def describe(self) -> str:
        """``window:W`` or ``state``, with ``xWIDTH`` when wider than one group."""
        name = f"window:{self.window_tokens}" if self.is_window else "state"
        return name if self.width == 1 else f"{name}x{self.width}"


def check_components(components: object) -> tuple[ComponentSpec, ...]:
    """``components`` as a tuple of :class:`ComponentSpec` (a list or tuple of them)."""
    if isinstance(components, ComponentSpec) or not isinstance(components, Sequence) or isinstance(
        components, str | bytes
    ):
        raise TypeError(
            f"components: expected a list or tuple of ComponentSpec, got {type(components).__name__}"
        )
    for i, spec in enumerate(components):
        if not isinstance(spec, ComponentSpec):
            raise TypeError(f"components[{i}]: expected ComponentSpec, got {type(spec).__name__}")
    return tuple(components)


_SPEC_TEXT = re.compile(r"(window):(\d+)(?:x(\d+))?|(state)(?:x(\d+))?")


def parse_components(value: object) -> tuple[ComponentSpec, ...]:
    """Components from their text form or a sequence of specs, texts or mappings.

    Text: comma-separated :meth:`ComponentSpec.describe` forms, e.g.
    ``"window:4096x5,state"`` (a window of 4,096 tokens over 5 groups of layers, and
    a recurrent state over one); ``""`` is none. A mapping holds the spec's fields.
    """
    if isinstance(value, str):
        items: Sequence[object] = [v for v in (p.strip() for p in value.split(",")) if v]
    elif isinstance(value, Sequence) and not isinstance(value, bytes):
        items = value
    else:
        raise TypeError(
            f"components: expected a text like 'window:4096x5,state' or a list of "
            f"ComponentSpec, got {type(value).__name__}"
        )
    specs = []
    for item in items:
        if isinstance(item, ComponentSpec):
            specs.append(item)
        elif isinstance(item, str):
            m = _SPEC_TEXT.fullmatch(item.strip())
            if m is None:
                raise ValueError(
                    f"components: expected 'window:TOKENS[xWIDTH]' or 'state[xWIDTH]', "
                    f"got {item!r}"
                )
            if m.group(1):
                specs.append(ComponentSpec("window", int(m.group(2)), int(m.group(3) or 1)))
            else:
                specs.append(ComponentSpec("state", width=int(m.group(5) or 1)))
        elif isinstance(item, dict):
            try:
                specs.append(ComponentSpec(**item))
            except TypeError as exc:
                raise TypeError(f"components: {exc}") from None
        else:
            raise TypeError(
                f"components: expected ComponentSpec, text or mapping items, got "
                f"{type(item).__name__}"
            )
    return tuple(specs)


def describe_components(components: Sequence[ComponentSpec]) -> str:
    """The text form :func:`parse_components` reads back (``""`` for none)."""
    return ",".join(spec.describe() for spec in components)
