"""`python -m training.serve`: one rank of a server (every rank of a tensor-parallel one runs it).

Rank 0 answers HTTP on a loopback port behind its front (training/serve/front.py, which holds the
API's address); the others load their shards and follow rank 0's requests. The controller
starts it on every node (`invoke serve`); by hand, on one machine:

    python -m training.serve --model models/smollm2-135m-float32 --adapter pirate=runs/20261125-101010
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from training.config import ConfigError
from training.serve import READY
from training.serve.adapters import AdapterError, parse
from training.serve.model import BASE

PARALLEL = ("tensor", "pipeline")


def arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="The base model's folder (on every node)")
    parser.add_argument("--base-name", help="The base's name in the API (default: its folder's name)")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=FOLDER",
                        help="An adapter folder (a run's) and its name in the API; again for more")
    parser.add_argument("--default", help="What a request without a model field gets (default: the "
                        "first adapter, else the base)")
    parser.add_argument("--host", default="127.0.0.1", help="Address rank 0 listens on (default loopback)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--api-key-file", type=Path,
                        help="A file holding the API key every request must send")
    parser.add_argument("--max-tokens", type=int, default=512, help="Default max_tokens of a request")
    parser.add_argument("--context", type=int, help="The longest request served, prompt and answer, in "
                        "tokens (default: the model's context; longer requests are a 400)")
    parser.add_argument("--prompt-cache-size", type=int, help="Prompts whose caches are kept for a later "
                        "request with the same beginning (default: mlx_lm.server's 10); every rank the same")
    parser.add_argument("--expected-world-size", type=int, help="Ranks the launcher was asked for")
    parser.add_argument("--parallel", choices=PARALLEL, default="tensor",
                        help="How several ranks hold the base: tensor (each a shard of every layer, the "
                             "default) or pipeline (each a stage of whole layers, in rank order)")
    parser.add_argument("--pipeline-layers", type=layer_counts, metavar="A,B,...",
                        help="With --parallel pipeline: each rank's layers, in rank order (default: as "
                             "equal as can be)")
    parser.add_argument("--batch", action=argparse.BooleanOptionalAction, default=True,
                        help="Batch the requests as mlx_lm.server does, adapters mixed in a batch "
                             "(default), or "
                             "--no-batch: one at a time, each as mlx_lm generate answers it")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--tag", help="Names this server's processes (the controller stops them by it)")
    parser.add_argument("--await-reason", type=float, default=0.0, metavar="SECONDS",
                        help="How long the front holds a broken-off answer for the controller's word on "
                             "which node went away (invoke serve says it; 0 by hand)")
    parser.add_argument("--log-level", default="WARNING")
    return parser.parse_args(argv)


def layer_counts(text: str) -> list[int]:
    """`--pipeline-layers 10,14,6` as numbers."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers, one per rank: 10,14,6") from None


def served_context(given: int | None, config: Mapping[str, Any]) -> int | None:
    """The longest request served: --context, at most the model's own context (None: neither said)."""
    from training.serve import server

    own = server.context_length(config)
    return min(given, own) if given and own else given or own


def watch(generator: Any, grace: float = 2.0) -> None:
    """Stop rank 0 when its generation thread has died (another rank went away, its collectives
    failed): the waiting clients get mlx-lm's error first, then the process exits non-zero, which
    the launcher and the controller see."""
    while generator.generation_available():
        time.sleep(0.5)
    time.sleep(grace)
    print("error: generation stopped (a rank went away or failed; see above): the server exits",
          file=sys.stderr, flush=True)
    os._exit(1)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ) -> int:
    args = arguments(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(message)s")
    try:
        adapters = parse(args.adapter)
    except AdapterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    base_name = args.base_name or Path(args.model).name
    default = args.default or (adapters[0].name if adapters else BASE)
    if default not in (BASE, base_name, *(a.name for a in adapters)):
        print(f"error: --default {default}: not the base ({base_name}) or an adapter", file=sys.stderr)
        return 2
    api_key = args.api_key_file.read_text().strip() if args.api_key_file else None

    from training.distributed import DistributedError, init_distributed
    from training.serve import front, server
    from training.serve.model import load
    from training.serve.stages import load_stage
    from training.sharding.tensor_parallel import check_collectives

    try:
        group = init_distributed(environ, args.expected_world_size)
        if group.size() > 1:
            check_collectives(group, environ)
        tokenizer_config = {"trust_remote_code": args.trust_remote_code}
        if args.parallel == "pipeline":
            served = load_stage(args.model, adapters, group, counts=args.pipeline_layers,
                                tokenizer_config=tokenizer_config)
        else:
            served = load(args.model, adapters, group, tokenizer_config=tokenizer_config)
    except (ConfigError, DistributedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    config = json.loads((Path(args.model) / "config.json").read_text())
    provider = server.Provider(
        server.cli_args(args.model, max_tokens=args.max_tokens, trust_remote_code=args.trust_remote_code),
        served, base_name, BASE if default == base_name else default, served_context(args.context, config),
        batch=args.batch)
    generator = server.Generator(provider, server.prompt_cache(provider, args.prompt_cache_size))
    if group.rank() != 0:
        generator.join()  # returns only when generation stopped: a rank went away
        return 1
    threading.Thread(target=watch, args=(generator,), daemon=True).start()
    # Rank 0 answers on loopback, behind its front (training/serve/front.py), which holds the API's
    # address and tells a client whose answer breaks off why: under MPI a dead rank takes rank 0 with it.
    httpd = server.http_server(generator, api_key)
    try:
        front.start(args.host, args.port, httpd.server_address[1], args.tag, args.await_reason)
    except front.FrontError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    print(ready_line(args, group.size(), served, base_name, default), flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        httpd.shutdown()
        generator.stop_and_join()
    return 0


def ready_line(args: argparse.Namespace, ranks: int, served: Any, base_name: str, default: str) -> str:
    """What rank 0 says once clients can ask: where, on how many ranks, the models, their memory."""
    from training.serve import server

    sizes = ", ".join(f"{name} {size / 2**20:.1f} MB" for name, size in served.adapter_bytes.items())
    stages = f" in pipeline stages of {','.join(map(str, served.stages))} layers" if served.stages else ""
    return (f"{READY} http://{args.host}:{args.port}/v1 on {ranks} rank(s){stages}; "
            f"{server.names_line(base_name, list(served.sets), default if default != base_name else BASE)}"
            f"{'; adapters per rank: ' + sizes if sizes else ''}; base {served.base_weights}")


if __name__ == "__main__":
    sys.exit(main())
