"""Quick start: hicache in front of a model, one request at a time.

Three requests run through a deliberately small device tier: A and C share a
long system prompt, B shares nothing and pushes A's pages out of the device
tier. Write-through already copied them to host memory, so C finds the system
prompt there and loads it back instead of recomputing it. C's tokens are then
checked against a model run that uses no cache at all.

    python examples/quickstart.py                  # CPU, a few seconds
    python examples/quickstart.py --device cuda    # the device tier on a GPU

The model is hicache's seeded random-weight reference decoder
(:mod:`hicache.sim.model`); an engine would call its own model the same way.
"""

from __future__ import annotations

import argparse

import torch

from hicache import CacheConfig, HiCache, Model, preset


# --8<-- [start:generate]
def generate(cache: HiCache, model: Model, prompt_tokens: torch.Tensor,
             max_new_tokens: int) -> list[int]:
    """Greedy decoding of one request with its prefix KV taken from the cache."""
    # Match all but the last prompt token: the last one is always computed, since its
    # logits choose the first new token (a fully cached prompt would leave nothing to run).
    h = cache.match(prompt_tokens[:-1])  # locks the cached prefix; host pages start loading
    try:
        # KV slots still missing: the uncached prompt tail and every generated token
        # but the last (it is never fed back).
        num_tokens = len(prompt_tokens) - h.prefix_len + max_new_tokens - 1
        if cache.alloc(h, num_tokens) is None:
            raise RuntimeError("device tier full of pages other requests hold")
        # Prefill the uncached tail; before layer i reads the pool, h.wait_layer(i)
        # waits for that layer's loaded KV (a failed load raises LoadError).
        logits = model.forward(prompt_tokens[h.prefix_len:], h.page_table(), h.prefix_len,
                               cache.device_pool, load_handle=h, last_only=True)
        cache.finish_loads(h)
        output_tokens = [int(logits[-1].argmax())]
        for step in range(1, max_new_tokens):  # decode into the same pages
            logits = model.forward(torch.tensor(output_tokens[-1:]), h.page_table(),
                                   len(prompt_tokens) + step - 1, cache.device_pool)
            output_tokens.append(int(logits[-1].argmax()))
        # Cache every whole page of what now has KV; backups to host memory start.
        cache.insert(h, torch.cat((prompt_tokens, torch.tensor(output_tokens[:-1]))))
    finally:
        cache.release(h)  # unlock; the KV stays cached for later requests
    return output_tokens
# --8<-- [end:generate]


def generate_without_cache(model: Model, prompt_tokens: torch.Tensor,
                           max_new_tokens: int) -> list[int]:
    """The same greedy decoding, recomputing everything each step (the yardstick)."""
    seq = prompt_tokens.clone()
    out: list[int] = []
    for _ in range(max_new_tokens):
        out.append(int(model.prefill_reference(seq)[-1].argmax()))
        seq = torch.cat((seq, torch.tensor(out[-1:])))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="hicache quick start (see the module docstring)")
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda[:N]' (default: cpu)")
    parser.add_argument("--max-new-tokens", type=int, default=8,
                        help="tokens generated per request (default: 8)")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here")

    model = Model(preset("small"), device=args.device, seed=0)
    kv = model.kv_config(page_size=16)
    # A device tier of 24 pages (384 tokens) holds one request at a time; the host tier
    # holds four times as much. Both are a few MB: CPU-sized.
    config = CacheConfig(kv, device_tokens=384, host_ratio=4.0, device=args.device)
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, model.config.vocab_size, (n,), generator=gen)

    system_prompt = tokens(256)
    requests = {
        "A": torch.cat((system_prompt, tokens(40))),
        "B": tokens(300),  # shares nothing: evicts A's pages from the device tier
        "C": torch.cat((system_prompt, tokens(40))),
    }
    with HiCache(config) as cache:
        outputs, hits = {}, {}
        for name, prompt in requests.items():
            before = cache.stats()
            outputs[name] = generate(cache, model, prompt, args.max_new_tokens)
            cache.wait_all()  # let this request's backups land (an engine would not wait)
            after = cache.stats()
            hits[name] = (after["device_hit_tokens"] - before["device_hit_tokens"],
                          after["host_hit_tokens"] - before["host_hit_tokens"])
            print(f"request {name}: {len(prompt)} prompt tokens, {hits[name][0]} found on the "
                  f"device, {hits[name][1]} loaded from host memory; generated {outputs[name]}")
        cache.check_integrity()
    # C reuses the whole system prompt, and part of it came back from host memory.
    assert sum(hits["C"]) == len(system_prompt) and hits["C"][1] > 0, hits
    same = outputs["C"] == generate_without_cache(model, requests["C"], args.max_new_tokens)
    print(f"C's tokens {'match' if same else 'DIFFER FROM'} a run without the cache")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
