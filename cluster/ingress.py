"""The HTTP ingress: OpenAI-compatible FastAPI app that validates, tokenizes once and streams.

Per request: check the API key, read the body under ``max_request_body_bytes`` (413 past
it), parse it strictly (400 naming the field), check the model (404), apply the chat
template and tokenize once, fit ``max_tokens`` into the context (400), hash the prompt's
blocks for the router, then call ``EngineReplica.generate`` through a streaming
``DeploymentHandle``. The first replica output is awaited before any byte is sent, so a
refusal (bad input 400, full queue 429 with Retry-After, dead engine 503) is a proper
status; with ``expose_replica_headers`` the serving replica goes out in the
``x-prefixserve-replica`` header. Failures
after the stream started end it with an ``error`` event and ``[DONE]``. A client that goes
away cancels the handle calls, which aborts the engine requests and frees their blocks.
Each replica times its requests (``cluster.metrics_snapshots.IngressMetrics``: TTFT, queue time,
e2e, finish reasons) and pushes the counts to the metrics hub; ``/metrics`` on any replica
shows their sum.
A request's ``model`` may name a LoRA adapter (``cluster/model_catalog.py``): it runs on that
adapter; ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change the adapters on every
engine replica (with ``enable_lora`` only; 400 otherwise).
Several ingress replicas may run; ``x-prefixserve-ingress`` names the one that answered. Each
replica's app gets ``ClusterConfig.root_path`` and, with ``allowed_origins``, CORS.
"""

# No `from __future__ import annotations` here: FastAPI must see the real `Request` type on
# the methods of the Serve ingress class, or it treats `request` as a query parameter.
import asyncio
import functools
import hmac
import logging
import os
import time
import uuid

import jinja2
import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster import errors
from cluster.anthropic_messages import MessageEvents, MessagesRequest, message_object
from cluster.config import API_KEY_ENV, ClusterConfig
from cluster.engine_client import EngineClient
from cluster.errors import APIError
from cluster.gc_tuning import collect_young_less_often
from cluster.lora_adapters import (
    AdapterCatalog,
    AdapterRecord,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from cluster.metrics import (
    any_replica_serving,
    push_snapshots_forever,
    router_metrics_snapshot,
)
from cluster.metrics_render import render_prometheus
from cluster.metrics_snapshots import IngressMetrics, sum_ingress_snapshots
from cluster.model_catalog import ModelCatalog
from cluster.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    ignored_field_counts,
    parse_body,
    resolve_max_tokens,
)
from cluster.openai_responses import (
    ResponseEvents,
    ResponsesRequest,
    new_id,
    output_messages,
    output_of_chat,
    response_object,
)
from cluster.push_socket import PushServer
from cluster.response_store import store_actor, tenant_of
from cluster.responses import ResponseBuilder
from cluster.router_context import router_context
from cluster.serve_compat import own_replica_id, replica_of, stream_handle
from cluster.stream_items import check_item
from cluster.tool_calls import (
    ToolPlan,
    apply_tool_plan,
    plan_tool_calls,
    template_inputs,
    template_renders_tools,
)
from router.config import RouterConfig
from worker import EngineConfig
from worker.cpu_claims import keep_off_claims
from worker.loader import load_frontend
from worker.outputs import OutputDelta

# Serve routes the "ray.serve" logger into each replica's log file.
log = logging.getLogger("ray.serve")

REPLICA_HEADER = "x-prefixserve-replica"
# Names the ingress replica that answered (several may run; they share one prefix index).
INGRESS_HEADER = "x-prefixserve-ingress"
# /health and /metrics must answer even when the hub or every replica is wedged.
HEALTH_TIMEOUT_S = 2.0


def replica_headers(cluster: ClusterConfig, engine_replicas: str, ingress_replica: str) -> dict:
    """The response headers naming who served a request: none unless the cluster exposes them
    (``ClusterConfig.expose_replica_headers``)."""
    if not cluster.expose_replica_headers:
        return {}
    return {REPLICA_HEADER: engine_replicas, INGRESS_HEADER: ingress_replica}


app = FastAPI(title="prefixserve", docs_url=None, redoc_url=None)


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.to_response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), err_type=err_type).to_response()


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return errors.bad_request(str(exc)).to_response()


@serve.deployment
@serve.ingress(app)
class Ingress:
    async def __init__(
        self,
        engine,
        metrics_hub,
        engine_config: dict,
        cluster_config: dict,
        router_config: dict | None = None,
    ) -> None:
        keep_off_claims("ingress replica")  # the engines' claimed CPUs are theirs alone
        self.engine_config = EngineConfig(**engine_config)
        self.cluster = ClusterConfig(**cluster_config)
        self._hub = metrics_hub
        self._api_key = self.cluster.api_key or os.environ.get(API_KEY_ENV) or None
        # Ask a replica rather than guess: hashes, limits and names must match the engine's.
        info = await engine.describe.remote()
        self.model_id: str = info["model_id"]
        self.max_model_len: int = info["max_model_len"]
        self.block_size: int = info["block_size"]
        self.vocab_size: int = info["vocab_size"]
        # The request router of this process's handle shares this context: it feeds the same
        # tracker (its decisions; the client reports each call's first output to it) and
        # names the Redis index by the model id.
        routing = router_context(serve.get_replica_context().app_name)
        routing.model_id = self.model_id
        self._push_server = None
        if self.cluster.push_outputs:  # engine replicas push outputs here (push_socket.py)
            self._push_server = await PushServer.start(
                lambda batch: self.engines.deliver(batch), ray.util.get_node_ip_address()
            )
        self.engines = EngineClient(
            stream_handle(engine, grpc=self.cluster.handle_transport == "grpc"),
            block_size=self.block_size,
            cache_namespace=info["cache_namespace"],
            push_to=None
            if self._push_server is None
            else {"replica_id": own_replica_id(), **self._push_server.address},
            load=routing.load,
        )
        # The base model's names and the LoRA adapters: the engines' lora_modules and the
        # runtime loads and unloads recorded in the application's index actor.
        self._engine_deployment = (engine.app_name, engine.deployment_name)
        record = AdapterRecord(
            serve.get_replica_context().app_name, RouterConfig(**(router_config or {}))
        )
        adapters = AdapterCatalog(
            self.engine_config.lora_modules, record.read, enabled=self.engine_config.enable_lora
        )
        self.model_catalog = ModelCatalog(
            served_name=self.cluster.served_model_name or self.model_id,
            model_id=self.model_id,
            max_model_len=self.max_model_len,
            adapters=adapters,
            record=record,
            engine_replicas=self._engine_replicas,
            other_names=() if self.cluster.served_model_name else (self.engine_config.model,),
        )
        self.served_name = self.model_catalog.served_name
        await adapters.refresh()
        # The model's generation_config.json fills sampling fields a request leaves unset.
        self.tokenizer, self.generation_defaults = await asyncio.to_thread(
            load_frontend, self.engine_config, info["tokenizer_class"]
        )
        # A template that ignores `tools` gets them written into the system message instead.
        self.template_renders_tools = await asyncio.to_thread(
            template_renders_tools,
            lambda messages, tools: self.tokenizer.apply_chat_template(messages, True, tools=tools),
        )
        self._ingress_id = serve.get_replica_context().replica_id.unique_id
        self._response_store = store_actor(self.served_name)  # /v1/responses' stored ones
        # What clients see here, summed over ingress replicas through the hub at /metrics.
        self.request_metrics = IngressMetrics(self.max_model_len)
        self._push_task = asyncio.get_running_loop().create_task(self._push_metrics_forever())
        collect_young_less_often("ingress")

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this after ``__init__``, before the first request: this replica's copy
        of the app gets its CORS middleware and root_path from the cluster config."""
        app = self.app
        app.root_path = self.cluster.root_path
        if self.cluster.allowed_origins:
            app.add_middleware(
                CORSMiddleware,
                allow_origins=list(self.cluster.allowed_origins),
                allow_methods=list(self.cluster.allowed_methods),
                allow_headers=list(self.cluster.allowed_headers),
                expose_headers=[REPLICA_HEADER, INGRESS_HEADER]
                if self.cluster.expose_replica_headers
                else [],
            )
        return app

    # ---- request plumbing ---------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        """The API key as OpenAI's clients send it (``Authorization: Bearer KEY``) or as
        Anthropic's do (``x-api-key: KEY``)."""
        key = self._api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise errors.unauthorized()

    async def _parse(self, request: Request, model_cls):
        self._authorize(request)
        limit = self.cluster.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise errors.bad_request("invalid Content-Length header")
            if int(declared) > limit:
                raise errors.body_too_large(limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise errors.body_too_large(limit)
        return parse_body(model_cls, bytes(body))

    def _tool_plan(self, body: ChatCompletionRequest | TokenizeRequest) -> ToolPlan | None:
        return plan_tool_calls(
            body.tool_definitions(),
            body.tool_choice_value(),
            body.parallel_tool_calls,
            parser=self.cluster.tool_call_parser,
            enable_auto_tool_choice=self.cluster.enable_auto_tool_choice,
            strict_json_schema=self.cluster.strict_json_schema,
        )

    async def _chat_prompt_ids(
        self, body: ChatCompletionRequest | TokenizeRequest, tool_plan: ToolPlan | None
    ) -> list[int]:
        """A conversation's prompt tokens: the messages (and the tools, rendered by the
        template or written into the messages) through the chat template."""
        messages, tools = template_inputs(
            body.template_messages(), tool_plan, self.template_renders_tools
        )
        return await self._apply_template(
            messages, body.add_generation_prompt, tools, body.chat_template_kwargs
        )

    def _check_token_ids(self, token_ids: list[int], param: str) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise errors.bad_request(
                    f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})", param
                )

    def _count_finished(self, arrival_s: float, builder: ResponseBuilder, failed: bool) -> None:
        """Request-level metrics of a response that ended; unfinished choices count as
        ``error`` when it failed, else ``abort`` (the client left)."""
        self.request_metrics.finished(
            arrival_s,
            time.monotonic(),
            list(builder.num_prompt_tokens),
            [(choice.finish_reason, choice.num_tokens) for choice in builder.choices],
            "error" if failed else "abort",
        )

    async def _respond(
        self, body, builder: ResponseBuilder, opened: list, arrival_s: float
    ) -> Response:
        """``arrival_s``: ``time.monotonic()`` when the handler started (TTFT, queue, e2e)."""
        items, headers = self._merged(opened, arrival_s)
        if not body.stream:
            await self._collect(items, builder, arrival_s)
            return JSONResponse(builder.full_response(), headers=headers)

        events = self._relay(
            items, builder, arrival_s, builder.stream_events, builder.closing_events
        )
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    def _merged(self, opened: list, arrival_s: float):
        """(the request's outputs in order, the response headers naming its replicas); counts
        the request as started."""
        self.request_metrics.started(
            arrival_s, [stream.first for stream in opened], time.monotonic()
        )
        replicas = ",".join(dict.fromkeys(stream.first.replica_id for stream in opened))
        return self.engines.merge(opened), replica_headers(self.cluster, replicas, self._ingress_id)

    async def _relay(
        self, items, builder: ResponseBuilder, arrival_s: float, events_of, closing=None
    ):
        """The SSE events ``events_of(index, output)`` makes of each replica output, joined
        into one chunk per list of outputs that arrived together (each token keeps its own
        event; what piled up while this ingress was busy goes in one write); a failure mid-stream
        becomes one error event and ends the stream (``builder.failed`` says so). Then the
        events ``closing()`` returns, if given, as the last chunk: the HTTP response reads
        this generator itself, one level fewer per streamed token than a wrapper around it."""
        builder.failed = False
        try:
            async for index, outputs in items:
                events = []
                for item in outputs:
                    check_item(item)
                    events += events_of(index, item)
                if events:
                    yield "".join(events)
        except APIError as exc:
            builder.failed = True
            yield exc.sse_payload()
        except Exception as exc:
            builder.failed = True
            yield errors.unavailable(f"the replica failed mid-stream: {exc!r}").sse_payload()
        finally:
            self._count_finished(arrival_s, builder, builder.failed)
            await items.aclose()
        if closing is not None:
            yield "".join(closing())

    async def _collect(self, items, builder: ResponseBuilder, arrival_s: float) -> None:
        """Feeds every output of a non-streamed request to ``builder``; a replica failure is
        a 503, an engine error its own status."""
        failed = False
        try:
            async for index, outputs in items:
                for item in outputs:
                    check_item(item)
                    builder.add(index, item)
        except APIError:
            failed = True
            raise
        except Exception as exc:
            failed = True
            raise errors.unavailable(f"the replica failed mid-request: {exc!r}") from None
        finally:
            self._count_finished(arrival_s, builder, failed)
            await items.aclose()

    async def _encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)

    async def _apply_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[int]:
        try:
            return await asyncio.to_thread(
                self.tokenizer.apply_chat_template,
                messages,
                add_generation_prompt,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
        except ValueError as exc:
            if str(exc).startswith("chat_template_kwargs"):
                raise errors.bad_request(str(exc), "chat_template_kwargs") from None
            raise errors.bad_request(f"messages: {exc}", "messages") from None
        except jinja2.TemplateError as exc:  # the template's own raise_exception, or a bad kwarg
            raise errors.bad_request(
                f"messages: the chat template failed: {exc}", "messages"
            ) from None

    # ---- endpoints ----------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        arrival_s = time.monotonic()
        body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        lora_name = await self.model_catalog.resolve(body.model)
        builder, opened = await self._open_chat(body, f"chatcmpl-{uuid.uuid4().hex}", lora_name)
        return await self._respond(body, builder, opened, arrival_s)

    async def _open_chat(
        self, body: ChatCompletionRequest, request_id: str, lora_name: str | None = None
    ) -> tuple[ResponseBuilder, list]:
        """Checks, templates and sends a chat request to an engine replica (on LoRA adapter
        ``lora_name``, None: the base model); returns the builder of its response and the
        opened streams."""
        body.sampling_params(strict_json_schema=self.cluster.strict_json_schema)  # range checks
        tool_plan = self._tool_plan(body)
        prompt_ids = await self._chat_prompt_ids(body, tool_plan)
        tokens_param = (
            "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        )
        max_tokens = resolve_max_tokens(
            body.requested_max_tokens(),
            len(prompt_ids),
            self.max_model_len,
            prompt_param="messages",
            tokens_param=tokens_param,
        )
        if body.requested_max_tokens() is None and "max_tokens" in self.generation_defaults:
            max_tokens = min(max_tokens, self.generation_defaults["max_tokens"])  # max_new_tokens
        params = apply_tool_plan(
            body.sampling_params(
                max_tokens,
                self.generation_defaults,
                strict_json_schema=self.cluster.strict_json_schema,
            ),
            tool_plan,
        )
        opened = await self.engines.open_all(
            request_id, [prompt_ids], [params], body.cache_salt, lora_name
        )
        builder = ResponseBuilder(
            chat=True,
            request_id=request_id,
            model=lora_name or self.served_name,
            n=body.n,
            num_prompts=1,
            want_logprobs=body.logprobs,
            token_to_str=self.tokenizer.token_to_str,
            include_usage=body.include_usage,
            continuous_usage=bool(
                body.stream_options and body.stream_options.continuous_usage_stats
            ),
            tool_plan=tool_plan,
            want_prompt_logprobs=body.prompt_logprobs is not None,
        )
        return builder, opened

    @app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, answered by one chat request (cluster/openai_responses.py)."""
        arrival_s = time.monotonic()
        req: ResponsesRequest = await self._parse(request, ResponsesRequest)
        lora_name = await self.model_catalog.resolve(req.model)
        model_name = lora_name or self.served_name
        tenant = tenant_of(request.headers.get("authorization"))
        history: list[dict] = []
        if req.previous_response_id is not None:
            stored = await self._response_store.get.remote(tenant, req.previous_response_id)
            if stored is None:
                raise errors.not_found(
                    f"Response with id '{req.previous_response_id}' not found.",
                    "previous_response_id",
                )
            history = stored
        body = req.chat_request(history, stream=req.stream)
        response_id = new_id("resp")
        builder, opened = await self._open_chat(body, response_id, lora_name)
        conversation = history + req.input_messages()
        items, headers = self._merged(opened, arrival_s)

        async def store(output: list[dict]) -> None:
            if req.store:
                await self._response_store.put.remote(
                    tenant, response_id, conversation + output_messages(output)
                )

        if not req.stream:
            await self._collect(items, builder, arrival_s)
            output, finish_reason = output_of_chat(builder.full_response())
            await store(output)
            response = response_object(
                req,
                response_id,
                model_name,
                int(time.time()),
                output,
                finish_reason,
                builder.usage(),
            )
            return JSONResponse(response, headers=headers)

        stream = ResponseEvents(req, response_id, model_name)
        finish: list[str | None] = [None]

        def events_of(index: int, item: OutputDelta) -> list[str]:
            events = []
            for state, new_text, _ in builder.add(index, item):
                finish[0] = state.finish_reason or finish[0]
                events += stream.feed(ResponseBuilder.chat_delta(state, new_text))
            return events

        async def events():
            for event in stream.start():
                yield event
            async for event in self._relay(items, builder, arrival_s, events_of):
                yield event
            if not builder.failed:
                for event in stream.finish(finish[0], builder.usage()):
                    yield event
                await store(stream.output)

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/messages")
    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API, answered by one chat request (anthropic_messages.py)."""
        arrival_s = time.monotonic()
        req: MessagesRequest = await self._parse(request, MessagesRequest)
        lora_name = await self.model_catalog.resolve(req.model)
        model_name = lora_name or self.served_name
        message_id = f"msg_{uuid.uuid4().hex}"
        builder, opened = await self._open_chat(req.chat_request(), message_id, lora_name)
        items, headers = self._merged(opened, arrival_s)
        if not req.stream:
            await self._collect(items, builder, arrival_s)
            message = message_object(builder.full_response(), message_id, model_name)
            return JSONResponse(message, headers=headers)

        stream = MessageEvents(message_id, model_name)
        last: list = [None, None, False]  # the choice's state, its finish reason, started

        def events_of(index: int, item: OutputDelta) -> list[str]:
            events = [] if last[2] else stream.start(item.num_prompt_tokens)
            last[2] = True
            for state, new_text, _ in builder.add(index, item):
                last[0] = state
                events += stream.feed(ResponseBuilder.chat_delta(state, new_text))
                if state.finish_reason is not None:
                    last[1] = ResponseBuilder.chat_finish_reason(state, state.tool_stream)
            return events

        async def events():
            async for event in self._relay(items, builder, arrival_s, events_of):
                yield event
            if not builder.failed:
                for event in stream.finish(last[0], last[1], builder.usage()):
                    yield event

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        arrival_s = time.monotonic()
        body: CompletionRequest = await self._parse(request, CompletionRequest)
        lora_name = await self.model_catalog.resolve(body.model)
        body.sampling_params(strict_json_schema=self.cluster.strict_json_schema)
        prompts, texts = [], []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                prompts.append(await self._encode(prompt))
                texts.append(prompt)
            else:
                self._check_token_ids(prompt, "prompt")
                prompts.append(list(prompt))
                texts.append(None)  # decoded only to echo it
        params = []
        for prompt_ids in prompts:
            max_tokens = resolve_max_tokens(
                body.max_tokens if body.max_tokens is not None else 16,
                len(prompt_ids),
                self.max_model_len,
                prompt_param="prompt",
                tokens_param="max_tokens",
            )
            params.append(
                body.sampling_params(
                    max_tokens,
                    self.generation_defaults,
                    strict_json_schema=self.cluster.strict_json_schema,
                )
            )
        request_id = f"cmpl-{uuid.uuid4().hex}"
        opened = await self.engines.open_all(
            request_id, prompts, params, body.cache_salt, lora_name
        )
        builder = ResponseBuilder(
            chat=False,
            request_id=request_id,
            model=lora_name or self.served_name,
            n=body.n,
            num_prompts=len(prompts),
            want_logprobs=body.logprobs is not None,
            token_to_str=self.tokenizer.token_to_str,
            include_usage=body.include_usage,
            continuous_usage=bool(
                body.stream_options and body.stream_options.continuous_usage_stats
            ),
            echo_prompts=self._echo_prompts(texts, prompts) if body.echo else None,
            num_top_logprobs=body.logprobs or 0,
            want_prompt_logprobs=body.prompt_logprobs is not None,
        )
        return await self._respond(body, builder, opened, arrival_s)

    def _echo_prompts(
        self, texts: list[str | None], prompts: list[list[int]]
    ) -> list[tuple[str, list[int]]]:
        """Each prompt's text and ids for ``echo``: a prompt given as ids is decoded here."""
        decode = self.tokenizer.decode
        return [
            (decode(ids, skip_special_tokens=False) if text is None else text, ids)
            for text, ids in zip(texts, prompts, strict=True)
        ]

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        """The base model, then every LoRA adapter (``parent``: the base model)."""
        self._authorize(request)
        return {"object": "list", "data": await self.model_catalog.cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> dict:
        """One model's card (``client.models.retrieve``): the served name or any name the
        server accepts for it, or a LoRA adapter's; anything else is a 404
        ``model_not_found``."""
        self._authorize(request)
        return await self.model_catalog.card(model_id)

    # ---- LoRA adapters at runtime (cluster/model_catalog.py) ----------------------------
    async def _engine_replicas(self) -> dict:
        """The engine replicas serving now (those reporting to the metrics hub, alive), each
        as a function that looks its actor up."""
        snapshots = await self._snapshots()
        if not snapshots:
            raise errors.unavailable("no engine replica is serving right now; retry later")
        app_name, deployment = self._engine_deployment
        return {
            replica_id: functools.partial(replica_of, app_name, deployment, replica_id)
            for replica_id, snap in sorted(snapshots.items())
            if snap.get("alive", False)
        }

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's runtime load: ``{"lora_name", "lora_path"}`` onto every engine replica."""
        body: LoadLoRAAdapterRequest = await self._parse(request, LoadLoRAAdapterRequest)
        text = await self.model_catalog.load_adapter(body.lora_name, body.lora_path)
        return Response(text, media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's runtime unload: ``{"lora_name"}`` from every engine replica."""
        body: UnloadLoRAAdapterRequest = await self._parse(request, UnloadLoRAAdapterRequest)
        text = await self.model_catalog.unload_adapter(body.lora_name)
        return Response(text, media_type="text/plain")

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> dict:
        body: TokenizeRequest = await self._parse(request, TokenizeRequest)
        await self.model_catalog.resolve(body.model)
        body.check()
        if body.messages is not None:
            token_ids = await self._chat_prompt_ids(body, self._tool_plan(body))
        else:
            token_ids = await self._encode(body.prompt, body.add_special_tokens)
        return {"tokens": token_ids, "count": len(token_ids), "max_model_len": self.max_model_len}

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> dict:
        body: DetokenizeRequest = await self._parse(request, DetokenizeRequest)
        await self.model_catalog.resolve(body.model)
        self._check_token_ids(body.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    async def _snapshots(self) -> dict[str, dict] | None:
        try:
            return await asyncio.wait_for(self._hub.snapshots.remote(), HEALTH_TIMEOUT_S)
        except Exception as exc:
            log.warning("metrics hub unreachable: %r", exc)
            return None

    @app.get("/health")
    async def health(self) -> Response:
        snapshots = await self._snapshots()
        if snapshots is not None and any_replica_serving(snapshots):
            return Response(status_code=200)
        return errors.unavailable("no engine replica can serve right now").to_response()

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """Engine replicas' series and the sum over every ingress replica (this one fresh)."""
        try:
            export = await asyncio.wait_for(self._hub.export.remote(), HEALTH_TIMEOUT_S)
        except Exception as exc:
            log.warning("metrics hub unreachable: %r", exc)
            export = {"replicas": {}, "ingresses": {}}
        ingresses = {**export["ingresses"], self._ingress_id: self._metrics_snapshot()}
        ingress = sum_ingress_snapshots(ingresses.values())
        body = render_prometheus(
            export["replicas"],
            ingress["router"],
            ingress_snapshot=ingress,
            prefix=self.cluster.prometheus_prefix,
        )
        return Response(body, media_type="text/plain; version=0.0.4")

    def _metrics_snapshot(self) -> dict:
        snapshot = self.request_metrics.snapshot(self.served_name, router_metrics_snapshot())
        snapshot["ignored_fields"] = ignored_field_counts()  # this process's parser's counts
        return snapshot

    async def _push_metrics_forever(self) -> None:
        """This ingress's counts to the hub (``push_snapshots_forever``: an idle ingress's
        do not change, so it pushes them every few seconds, not every second)."""
        await push_snapshots_forever(
            lambda snapshot: self._hub.report_ingress.remote(self._ingress_id, snapshot),
            self._metrics_snapshot,
            "ingress",
        )

    async def __del__(self) -> None:
        """Serve's shutdown: the last counts go to the hub, which keeps them."""
        self._push_task.cancel()
        if self._push_server is not None:
            self._push_server.close()
        try:
            snapshot = self._metrics_snapshot()
            await asyncio.wait_for(self._hub.report_ingress.remote(self._ingress_id, snapshot), 1.0)
        except Exception as exc:
            log.debug("last metrics push failed: %s", exc)
