"""mlx-lm's OpenAI-compatible server (mlx_lm/server.py) over a served model: its HTTP handler, its
request queue, its generation thread and its way of running every rank in step, with what it lacks
for a sharded base with several adapters.

What is mlx-lm's, unchanged: the endpoints and request fields (/v1/chat/completions,
/v1/completions, /v1/models, /health; stream, temperature, top_p, max_tokens, stop, seed, logprobs
...), server-sent events, and in distributed mode rank 0 serving HTTP and handing each request to
the other ranks, which run the same generation steps.

What is ours:
- the `model` field picks the base or an adapter (training/serve/model.py switches them); a name
  the server does not have, or mlx-lm's own `adapters` field, is a 400 that lists what it has;
- /v1/models lists the base and each adapter; /health says rank 0's memory now and at its peak;
- a prompt that with its max_tokens would not fit the context served (the model's, or --context) is a 400;
- an API key, when one is set: every request without `Authorization: Bearer <key>` is a 401;
- requests are batched as mlx-lm batches them (its continuous batching and prompt cache), requests
  for different adapters in one batch, each row answered with its own adapter
  (training/serve/mixed.py), the prompt cache kept apart per adapter; or with `batch=False` answered
  one at a time, each as `mlx_lm generate` answers it;
- in distributed mode a client that goes away does not stop a lone request's generation midway
  (mlx-lm's single-request path would stop rank 0 alone and leave the ranks out of step): the
  request runs to its end, its tokens unsent. A batched request stops on every rank, as mlx-lm
  shares the stop.
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.server import (
    APIHandler,
    GenerationArguments,
    ModelDescription,
    ModelProvider,
    ResponseGenerator,
    get_system_fingerprint,
)

from training.serve.mixed import MIXED, Mixing, Picks, PromptCaches
from training.serve.model import BASE, Served

DEFAULT_MODEL = "default_model"  # mlx-lm's name for a request without a model field
# mlx_lm.server's defaults (its argument parser), for the fields its code reads.
STOCK_DEFAULTS: Mapping[str, Any] = {
    "adapter_path": None, "draft_model": None, "num_draft_tokens": 3, "trust_remote_code": False,
    "chat_template": "", "use_default_chat_template": False, "chat_template_args": {}, "temp": 0.0,
    "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 512, "allowed_origins": ["*"],
    "decode_concurrency": 32, "prompt_concurrency": 8, "prefill_step_size": 2048,
    "prompt_cache_size": 10, "prompt_cache_bytes": None, "kv_bits": None, "kv_group_size": 64,
    "quantized_kv_start": 0, "pipeline": False,
}


STOCK_PROMPT_CACHE = STOCK_DEFAULTS["prompt_cache_size"]


def cli_args(model: str, **changes: Any) -> argparse.Namespace:
    """The settings mlx-lm's server classes read, as its command line would give them."""
    return argparse.Namespace(**{**STOCK_DEFAULTS, "model": model, **changes})


class UnknownModel(ValueError):
    pass


@dataclass
class Picked(GenerationArguments):
    """A request's arguments where one batch mixes adapters: mlx-lm sees one model (MIXED), so that
    it batches every request together, and `pick` names the served model that answers this one."""

    pick: str = BASE

    @classmethod
    def of(cls, args: GenerationArguments, pick: str) -> Picked:
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
        return cls(**{**fields, "model": ModelDescription(MIXED, args.model.draft, None)}, pick=pick)


class Provider(ModelProvider):
    """mlx-lm's model provider over one loaded model: a request's `model` names the base or an
    adapter, and switching is a module swap, not a reload; when batching with adapters, the model
    mlx-lm batches with is `mixing`, which answers each row with its request's pick."""

    def __init__(self, args: argparse.Namespace, served: Served, base_name: str, default: str,
                 context_length: int | None, batch: bool = True):
        super().__init__(args)
        self.batch = batch
        self.served = served
        self.base_name = base_name
        self.default = default
        self.context_length = context_length
        self.picks = Picks()
        self.mixing = Mixing(served, self.picks) if batch and served.sets else None

    @property
    def default_name(self) -> str:
        """The name of what answers a request without a model field."""
        return self.base_name if self.default == BASE else self.default

    @property
    def names(self) -> list[str]:
        """What a request's `model` may say: the base's name, then every adapter's."""
        return [self.base_name, *self.served.sets]

    def resolve(self, requested: str) -> str:
        """The served adapter (or BASE) a request's `model` names."""
        if requested == DEFAULT_MODEL:
            return self.default
        if requested in (self.base_name, BASE):
            return BASE
        if requested in self.served.sets:
            return requested
        raise UnknownModel(f"model {requested!r} is not served here; pick one of: {', '.join(self.names)}")

    def load(self, model_path: str, adapter_path: str | None = None, draft_model_path: str | None = None):
        if adapter_path is not None:
            raise ValueError("the adapters field is not taken here: pick an adapter with the model field, "
                             f"one of: {', '.join(self.names)}")
        if draft_model_path not in (None, DEFAULT_MODEL):
            raise ValueError("draft models are not served here")
        if model_path == MIXED and self.mixing is not None:
            name, model = MIXED, self.mixing
        else:
            name, model = self.resolve(model_path), self.served.model
            self.served.use(name)
        if self.model_key != ("served", name):
            # The key of mlx-lm's prompt and state-machine caches: one per adapter, never mixed
            # (when mixing, mixed.PromptCaches keys each cached prompt by its pick).
            self.model_key = ("served", name)
            self.model, self.tokenizer = model, self.served.tokenizer
            self.processor, self.draft_model = None, None
            # As mlx-lm decides it: every cache of the model can be merged into a batch.
            self.is_batchable = self.batch and all(hasattr(c, "merge") for c in make_prompt_cache(self.model))
        return self.model, self.tokenizer

    def load_default(self) -> None:
        self.load(DEFAULT_MODEL)


class Generator(ResponseGenerator):
    """mlx-lm's generation thread; when mixing adapters every request is one model's to mlx-lm,
    picking its adapter; in distributed mode a request whose client went away runs on to its end,
    so that every rank takes the same steps."""

    def generate(self, request, generation_args, progress_callback=None):
        provider = self.model_provider
        if provider.mixing is not None:
            generation_args = Picked.of(generation_args, provider.resolve(generation_args.model.model))
        ctx, responses = super().generate(request, generation_args, progress_callback)
        if self._is_distributed and not self._is_batchable(generation_args):
            ctx.stop = lambda: None
        return ctx, responses

    def _tokenize(self, tokenizer, request, args):
        # The request is being admitted (on every rank): its cache is fetched or made next.
        if isinstance(args, Picked):
            self.model_provider.picks.admitting = self.model_provider.served.names.index(args.pick)
        return super()._tokenize(tokenizer, request, args)


class OpenAIErrors:
    """The handler's output stream, which writes an error's body as OpenAI's clients read it:
    `{"error": {"message": ..., "type": ..., "code": <status>}}` (mlx-lm writes `{"error": "..."}`,
    whose message the openai package does not show)."""

    def __init__(self, stream: Any, handler: Handler):
        self.stream, self.handler = stream, handler

    def write(self, data: bytes) -> int:
        status = self.handler.status
        if status >= 400:
            try:
                body = json.loads(data)
            except ValueError:
                body = None
            message = body.get("error") if isinstance(body, dict) else None
            if isinstance(message, str):
                kind = "authentication_error" if status == 401 else "invalid_request_error"
                data = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                             "code": status}}).encode()
        return self.stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class Handler(APIHandler):
    """mlx-lm's HTTP handler, with the model names, the context check, the API key and OpenAI's
    shape of an error."""

    api_key: str | None = None  # set on the class by `handler_class`
    status = 200

    def setup(self) -> None:
        super().setup()
        self.wfile = OpenAIErrors(self.wfile, self)

    def send_response(self, code: int, message: str | None = None) -> None:
        self.status = code
        super().send_response(code, message)

    @property
    def provider(self) -> Provider:
        return self.response_generator.model_provider

    def _refused(self, status: int, message: str) -> None:
        self._set_completion_headers(status)
        self.end_headers()
        self.wfile.write(json.dumps({"error": message}).encode())

    def _authorized(self) -> bool:
        if not self.api_key:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            return True
        self._refused(401, "missing or wrong API key: send Authorization: Bearer <key>")
        return False

    def do_POST(self) -> None:
        if self._authorized():
            super().do_POST()

    def do_GET(self) -> None:
        if self.path == "/health" or self._authorized():
            super().do_GET()

    def handle_health_check(self) -> None:
        """mlx-lm's /health, with rank 0's memory: what MLX holds now and at its peak since the server
        started (bytes), to hold the serving plan (mlxcluster/plan/serving.py) to."""
        import mlx.core as mx

        healthy = self.response_generator.is_healthy
        self._set_completion_headers(200 if healthy else 503)
        self.end_headers()
        self.wfile.write(json.dumps({"status": "ok" if healthy else "unavailable",
                                     "active_memory_bytes": mx.get_active_memory(),
                                     "peak_memory_bytes": mx.get_peak_memory()}).encode())
        self.wfile.flush()

    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        self.provider.resolve(self.requested_model)
        if self.requested_model == DEFAULT_MODEL:  # the answer names what answered, not mlx-lm's alias
            self.requested_model = self.provider.default_name
        if self.adapter is not None:
            raise ValueError("the adapters field is not taken here: pick an adapter with the model field, "
                             f"one of: {', '.join(self.provider.names)}")
        self._check_context()

    def _check_context(self) -> None:
        """A prompt that, with max_tokens, would not fit the context served is refused, as OpenAI does."""
        limit = self.provider.context_length
        if not limit:
            return
        tokenizer = self.provider.served.tokenizer
        messages, prompt = self.body.get("messages"), self.body.get("prompt")
        try:
            if isinstance(messages, list):
                tokens = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                           tokenize=True))
            elif isinstance(prompt, str):
                tokens = len(tokenizer.encode(prompt))
            else:
                return  # mlx-lm says what is missing
        except Exception:  # a shape of message the template does not take: mlx-lm's own handling says
            return
        if tokens + self.max_tokens > limit:
            raise ValueError(f"the prompt is {tokens} tokens and max_tokens {self.max_tokens}: over the "
                             f"context of {limit} tokens this server takes (the model's, or invoke serve "
                             "--context); shorten the prompt or lower max_tokens")

    def handle_models_request(self) -> None:
        self._set_completion_headers(200)
        self.end_headers()
        models = [{"id": name, "object": "model", "created": self.created, "owned_by": "mlx-cluster"}
                  for name in self.provider.names]
        self.wfile.write(json.dumps({"object": "list", "data": models}).encode())
        self.wfile.flush()


def prompt_cache(provider: Provider, size: int | None = None) -> LRUPromptCache:
    """mlx_lm.server's prompt cache of `size` prompts (None: its own 10) when batching (a request's
    cached prefix is not computed again), kept apart per adapter when a batch mixes them; none one
    at a time, where each request is computed whole as mlx_lm generate computes it."""
    kept = STOCK_PROMPT_CACHE if size is None else size
    if provider.mixing is not None:
        return PromptCaches(provider.picks, kept)
    return LRUPromptCache(kept if provider.batch else 0)


def handler_class(api_key: str | None) -> type[Handler]:
    return type("KeyedHandler", (Handler,), {"api_key": api_key})


def http_server(generator: Generator, api_key: str | None) -> ThreadingHTTPServer:
    """mlx-lm's HTTP server (as its _run_http_server makes it) for rank 0, on a free loopback port:
    clients reach it through the front (training/serve/front.py)."""
    handler = handler_class(api_key)
    fingerprint = get_system_fingerprint()
    return ThreadingHTTPServer(("127.0.0.1", 0), lambda *args, **kwargs: handler(
        generator, *args, system_fingerprint=fingerprint, **kwargs))


def context_length(config: Mapping[str, Any]) -> int | None:
    """The model's context in tokens, from its config.json (None: not said)."""
    # The keys mlxcluster/plan/model.py's CONTEXT_KEYS holds (the plan of a server's cache reads them).
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "max_seq_len", "seq_length"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


def names_line(base_name: str, adapters: Sequence[str], default: str) -> str:
    picked = base_name if default == BASE else default
    return f"models: {', '.join([base_name, *adapters])} (a request without one gets {picked})"
