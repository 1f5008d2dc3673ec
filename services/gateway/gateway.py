"""The gateway's request logic: validate and tokenize a request, reserve its quota, queue it.

Request path: authenticate the tenant -> check the request rate -> validate and tokenize
(off the event loop) -> reserve quota -> queue for a slot -> generate on the backend ->
stream or return the answer (response.py) -> reconcile quota. The HTTP surface lives in
app.py and the routes_*.py routers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvrelay.engine import logits_processors
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.gateway import chat_render, errors, model_names, reasoning
from kvrelay.gateway.backend import Backend
from kvrelay.gateway.deadlines import request_timeout
from kvrelay.gateway.errors import ApiError
from kvrelay.gateway.frontdoor import FrontDoorLimits
from kvrelay.gateway.images import chat_image_prompt, fetch_chat_images
from kvrelay.gateway.media import MediaLimits
from kvrelay.gateway.metrics import GatewayMetrics
from kvrelay.gateway.quota import (
    Admission,
    MemoryQuotaStore,
    QuotaExceeded,
    QuotaManager,
    QuotaStoreBusy,
    QuotaStoreUnavailable,
)
from kvrelay.gateway.scheduler import FairScheduler, QueueFull, Ticket
from kvrelay.gateway.schemas import ChatCompletionRequest, CompletionRequest
from kvrelay.gateway.structured import tools as tool_calling
from kvrelay.gateway.structured.fields import checked, requested_spec
from kvrelay.gateway.tenants import Tenant, TenantRegistry

log = logging.getLogger(__name__)
PRIORITY_BAND = 10_000  # > 2 x MAX_REQUEST_PRIORITY
# A request with this little prompt text, and only fields that cost next to nothing to prepare (no
# grammar to compile, no tools to render, no logits processors to load, no token ids to check), is
# prepared on the event loop: the hop to a tokenizer thread and back costs more CPU (~150 us) than
# tokenizing it (benchmarks/gateway_cpu.py).
INLINE_PROMPT_CHARS = 256
_INLINE_FIELDS = frozenset({
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "min_p", "n", "stream", "stream_options", "stop", "seed", "user", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "ignore_eos", "logprobs", "top_logprobs", "echo", "cache_salt", "priority",
    "skip_special_tokens", "include_stop_str_in_output", "truncate_prompt_tokens", "add_generation_prompt"})


@dataclass
class GatewayConfig:
    max_queue: int = 1024  # requests waiting for a slot; past it: 503
    capacity: int | None = None  # sequences in flight on the backend; None: the backend's own
    max_body_bytes: int = 2 * 1024 * 1024  # larger bodies: 413
    lease_ttl_s: float = 30.0  # concurrency leases of a dead gateway free after this
    quota_fail_open: bool = False  # Redis unreachable: False -> 503, True -> enforce quotas locally
    quota_wait_s: float = 10.0  # how long an admission may wait for a free quota-store connection
    max_tenant_labels: int = 100
    default_reserve_tokens: int = 1024  # tokens reserved per sample for a request without max_tokens
    tenant_metrics: bool = True  # False: no per-tenant series at all (every tenant counts as `all`)
    max_prompt_bytes: int = 1024 * 1024  # UTF-8 bytes of prompt text (all prompts / messages); past it: 413
    tokenizer_threads: int = 4  # threads that tokenize and render chat templates
    tokenizer_queue: int = 1024  # preparations waiting for a thread; past it: 503
    allow_special_tokens: bool = False  # True: special-token text in prompts and messages acts as special
    frontdoor: FrontDoorLimits = field(default_factory=FrontDoorLimits)  # header and connection limits
    tools: tool_calling.ToolSettings = field(default_factory=tool_calling.ToolSettings)  # tool-call parser
    request_timeout_s: float | None = 600.0  # every request's deadline, capped per tenant; None: none
    chat_template: str | None = None  # --chat-template: jinja2 source replacing the model's own
    reasoning_parser: str | None = None  # --reasoning-parser: reasoning.PARSERS
    allowed_origins: list[str] = field(default_factory=list)  # --allowed-origins: CORS for browsers; []: none
    runtime_lora: bool = False  # --allow-runtime-lora-updating: /v1/load_lora_adapter and /v1/unload_lora_adapter
    media: MediaLimits = field(default_factory=MediaLimits)  # images in chat: counts, sizes, fetching (media.py)


@dataclass
class Prepared:
    """A validated request, ready for admission."""

    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    tenant: Tenant
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    reserve: int  # prompt tokens + max_tokens x n per prompt
    arrival: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))
    admission: Admission | None = None
    ticket: Ticket | None = None
    echo: list[str] | None = None  # completions with echo: each prompt's text, put before its choices' text
    cache_salt: str | None = None  # prefix-cache salt: the tenant's cache group and the request's cache_salt
    tools: tool_calling.ToolPlan | None = None  # chat with tools: how the output becomes tool calls
    score_only: bool = False  # completions with max_tokens 0 and echo: the prompt, nothing generated
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs: each choice carries them
    priority: int = 0  # the request's own priority, bounded by its tenant's max_request_priority
    reasoning: reasoning.ReasoningSplit | None = None  # chat with --reasoning-parser: thinking apart from content
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: every chunk carries the usage

    @property
    def engine_priority(self) -> int:
        """The tenant's band dominates (no request lifts itself over another band), then the request's."""
        return self.tenant.priority * PRIORITY_BAND + self.priority
    timeout_s: float | None = None  # the request's deadline, from arrival (deadlines.py)


class Gateway:
    def __init__(self, backend: Backend, tenants: TenantRegistry | None = None,
                 quota: QuotaManager | None = None, config: GatewayConfig | None = None):
        self.backend = backend
        self.config = config or GatewayConfig()
        self.tenants = tenants or TenantRegistry(None)
        self.quota = quota or QuotaManager(MemoryQuotaStore(), self.config.lease_ttl_s, self.config.quota_fail_open,
                                           self.config.quota_wait_s)
        self.metrics = GatewayMetrics(self.config.max_tenant_labels, self.config.tenant_metrics)
        # The engine's counters only where the engine runs in this process (workers export their own).
        in_process = "engine" in getattr(backend, "roles", ("engine",))
        self.metrics.attach_gauges(self._gauges, self.backend.stats if in_process else None)
        for collector in getattr(backend, "metric_collectors", list)():  # e.g. circuit breakers
            self.metrics.registry.register(collector)
        self.scheduler: FairScheduler | None = None
        self.running = 0
        self.draining = False  # SIGTERM's --shutdown-delay: still serving, but /ready answers 503 (drain.py)
        self._executor = ThreadPoolExecutor(self.config.tokenizer_threads, thread_name_prefix="kvrelay-tokenize")
        # One slot per thread; at most tokenizer_queue more wait (past it: 503), so a flood cannot
        # queue unbounded work.
        self._prepare_slots = asyncio.Semaphore(self.config.tokenizer_threads)
        self._prepare_waiting = 0

    async def start(self) -> None:
        await self.backend.start()
        if self.config.chat_template is not None:  # the backend's tokenizer exists once it started
            self.backend.tokenizer.set_chat_template(self.config.chat_template)
        capacity = self.config.capacity or self.backend.capacity
        self.scheduler = FairScheduler(capacity, self.config.max_queue)

    async def shutdown(self) -> None:
        await self.backend.shutdown()
        await self.quota.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _gauges(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        if self.scheduler is None:
            return {}
        model = self.backend.model_name
        stats = self.backend.stats()
        depth = self.scheduler.depth
        # Requests waiting at the gateway need every role, so each role's series shows the queue.
        out = {
            "kvrelay:gateway_queue_depth": [({"model": model, "role": role}, depth) for role in self.backend.roles],
            "kvrelay:num_requests_waiting": [({"model": model}, depth + (stats.num_waiting if stats else 0))],
            "kvrelay:num_requests_running": [({"model": model}, stats.num_running if stats else self.running)],
        }
        if stats is not None:
            out["kvrelay:kv_cache_usage_perc"] = [({"model": model}, stats.kv_usage)]
        return out

    # ------------------------------------------------------------------ validation

    def check_model(self, model: str, tenant: Tenant) -> None:
        """The model by a name it is served under (model_names.py); 404 or 403 otherwise."""
        model_names.check_model(self.backend, model, tenant)

    def _params(self, body, max_tokens: int | None, max_tokens_field: str, logprobs: int | None) -> SamplingParams:
        defaults = self.backend.default_sampling_params()
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        for s in stop:
            errors.check_text(s, "stop")
        params = SamplingParams(
            n=body.n, max_tokens=max_tokens, min_tokens=body.min_tokens,
            temperature=defaults.temperature if body.temperature is None else float(body.temperature),
            top_p=defaults.top_p if body.top_p is None else float(body.top_p),
            top_k=defaults.top_k if body.top_k is None else body.top_k,
            min_p=defaults.min_p if body.min_p is None else float(body.min_p),
            repetition_penalty=(defaults.repetition_penalty if body.repetition_penalty is None
                                else float(body.repetition_penalty)),
            presence_penalty=float(body.presence_penalty), frequency_penalty=float(body.frequency_penalty),
            # The engine seeds a 64-bit generator: fold any integer into its range, deterministically.
            seed=None if body.seed is None else body.seed % (2**63),
            stop=stop, ignore_eos=body.ignore_eos, logprobs=logprobs, logit_bias=_logit_bias(body.logit_bias),
            stop_token_ids=list(body.stop_token_ids or []), skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            allowed_token_ids=None if body.allowed_token_ids is None else list(body.allowed_token_ids),
            bad_words=list(body.bad_words) if body.bad_words else None,
            logits_processors=logits_processors.normalise(body.logits_processors),
            structured=checked(requested_spec(body), self.backend.tokenizer),
            prompt_logprobs=body.prompt_logprobs,
            lora=body.model if body.model in self.backend.lora_modules else None,
        )
        try:
            params.validate(self.backend.tokenizer.vocab_size)
        except InvalidRequestError as e:
            param = max_tokens_field if e.field == "max_tokens" else e.field
            raise errors.bad_request(str(e), param) from e
        return params

    def _fit_context(self, prompts: list[list[int]], params: SamplingParams, field_name: str) -> int:
        """Check every prompt fits the context with max_tokens; fill max_tokens when absent. Returns the
        tokens to reserve: without max_tokens, `default_reserve_tokens` per sample (generation may run to
        the context; the quota settles at what was used), so a small tokens-per-minute quota still
        admits chat clients that never send max_tokens."""
        limit = self.backend.max_model_len
        longest = max(len(p) for p in prompts)
        per_sample = params.max_tokens
        if params.max_tokens is None:
            if longest >= limit:
                raise ApiError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                               f"{longest}, which leaves no room to generate", param=field_name,
                               code="context_length_exceeded")
            params.max_tokens = limit - longest
            per_sample = min(params.max_tokens, self.config.default_reserve_tokens)
        elif longest + params.max_tokens > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens; the request asks for "
                           f"{longest + params.max_tokens} ({longest} in the prompt, {params.max_tokens} to "
                           "generate): shorten the prompt or lower max_tokens", param=field_name,
                           code="context_length_exceeded")
        return sum(len(p) + params.n * per_sample for p in prompts)

    def _truncate(self, prompts: list[list[int]], body) -> list[list[int]]:
        """vLLM's truncate_prompt_tokens: each prompt's last k tokens (-1: the context's length)."""
        k = body.truncate_prompt_tokens
        if k is None:
            return prompts
        if k == 0:
            raise errors.bad_request("truncate_prompt_tokens: must be -1 (the context's length) or at least 1",
                                     "truncate_prompt_tokens")
        k = self.backend.max_model_len if k == -1 else k
        if all(len(p) <= k for p in prompts):
            return prompts
        return [p[-k:] for p in prompts]

    def encode_prompts(self, raw: str | list, field_name: str) -> list[list[int]]:
        """OpenAI's prompt forms (a text, token ids, texts, lists of token ids) as token id lists."""
        if isinstance(raw, str):
            return [self._encode(raw, field_name)]
        if all(isinstance(x, int) for x in raw):
            return [list(raw)]
        return [self._encode(x, field_name) if isinstance(x, str) else list(x) for x in raw]

    def _encode(self, text: str, field_name: str) -> list[int]:
        errors.check_text(text, field_name)
        tok = self.backend.tokenizer
        if self.config.allow_special_tokens:
            return tok.encode_prompt(text)
        return tok.encode_plain(text)  # "</s>" in a prompt is text, not end-of-sequence

    # Tokenizing and rendering a chat template cost CPU in proportion to the prompt: they run in a
    # bounded thread pool (the tokenizers library releases the GIL), after authentication, the
    # model check, the byte bound and the request-rate check, so the event loop keeps answering.

    async def prepare_completion(self, body: CompletionRequest, tenant: Tenant) -> Prepared:
        self.check_model(body.model, tenant)
        model_names.check_runner(self.backend, body.model, "generate")
        raw = body.prompt
        texts = [raw] if isinstance(raw, str) else [x for x in raw if isinstance(x, str)]
        self._check_prompt_bytes(texts, "prompt")
        await self.check_request_rate(tenant)
        inline = isinstance(raw, str) and _inline(body, len(raw))
        return await self._offload(self._prepare_completion, body, tenant, inline=inline)

    async def prepare_chat(self, body: ChatCompletionRequest, tenant: Tenant) -> Prepared:
        self.check_model(body.model, tenant)
        model_names.check_runner(self.backend, body.model, "generate")
        texts = chat_render.message_texts(body.messages)
        self._check_prompt_bytes(texts, "messages")
        await self.check_request_rate(tenant)
        pictures = await fetch_chat_images(body, getattr(self.backend, "images", None), self.config.media)
        inline = pictures is None and _inline(body, sum(len(t) for t in texts))
        return await self._offload(self._prepare_chat, body, tenant, pictures, inline=inline)

    def cache_salt(self, tenant: Tenant, request_salt: str | None) -> str | None:
        """Tenants get prefix caches of their own (one per `prefix_cache_group` when set), so no tenant
        can hit or time another's cached prompts; a request's `cache_salt` splits it further. The
        open gateway (no tenants file, one tenant) keeps the plain, unsalted cache."""
        group = None if self.tenants.open else (tenant.prefix_cache_group or f"tenant:{tenant.id}")
        if request_salt:
            return f"{group or ''}\x00{request_salt}"
        return group

    def _check_prompt_bytes(self, texts: list[str], field_name: str) -> None:
        limit = self.config.max_prompt_bytes
        size = sum(len(t) for t in texts)  # characters: a cheap lower bound of the UTF-8 size
        if size <= limit // 4:
            return
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if size > limit:
            raise errors.too_large(f"{field_name}: {size} bytes of text exceed the limit of {limit} bytes "
                                   "(--max-prompt-bytes)", field_name)

    async def check_request_rate(self, tenant: Tenant) -> None:
        """Refuse a tenant already at its requests_per_minute before spending CPU on its prompt."""
        headers = await self.quota.requests_exhausted(tenant.id, tenant.quotas)
        if headers is not None:
            self.metrics.quota_rejections.labels(self.metrics.tenant(tenant.id), "requests_per_minute").inc()
            raise errors.rate_limited(
                f"Rate limit reached for tenant {tenant.id!r}: requests_per_minute quota exhausted; retry after "
                f"{headers['Retry-After']} s", "requests_per_minute", headers)

    async def _offload(self, fn, *args, inline: bool = False):
        if inline:
            return fn(*args)
        if self._prepare_waiting >= self.config.tokenizer_queue:
            raise errors.unavailable("The gateway is saturated: too many prompts waiting to be tokenized",
                                     "tokenizer_busy")
        self._prepare_waiting += 1
        try:
            await self._prepare_slots.acquire()
        finally:
            self._prepare_waiting -= 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._prepare_slots.release()

    def _prepare_completion(self, body: CompletionRequest, tenant: Tenant) -> Prepared:
        if body.user is not None:
            errors.check_text(body.user, "user")
        raw = body.prompt
        prompts = self.encode_prompts(raw, "prompt")
        truncated = self._truncate(prompts, body)
        echo_ids = truncated is not prompts  # echo what the model saw
        prompts = truncated
        vocab = self.backend.tokenizer.vocab_size
        if any(t >= vocab for p in prompts for t in p):
            raise errors.bad_request(f"prompt: token ids must be < the vocabulary size {vocab}", "prompt")
        if body.max_tokens == 0 and not body.echo:
            raise errors.bad_request("max_tokens: 0 is only for scoring the prompt, with `echo: true`", "max_tokens")
        # max_tokens 0: one token is computed (the engine always samples one) and not reported.
        params = self._params(body, body.max_tokens or (None if body.max_tokens is None else 1), "max_tokens",
                              body.logprobs)
        if body.echo and body.logprobs is not None:
            params.prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0)
        reserve = self._fit_context(prompts, params, "prompt")
        p = Prepared("completion", f"cmpl-{uuid.uuid4().hex}", model_names.answered_as(self.backend, body.model), tenant, prompts, params,
                     body.stream, bool(body.stream_options and body.stream_options.include_usage),
                     body.logprobs is not None, reserve)
        p.cache_salt = self.cache_salt(tenant, body.cache_salt)
        p.score_only = body.max_tokens == 0
        p.priority = _request_priority(body, tenant)
        p.prompt_logprobs = body.prompt_logprobs is not None
        p.continuous_usage = p.include_usage and body.stream_options.continuous_usage_stats
        if body.echo:
            if echo_ids:
                p.echo = [self.backend.tokenizer.decode(ids) for ids in prompts]
            elif isinstance(raw, str):
                p.echo = [raw]
            elif isinstance(raw[0], str):
                p.echo = list(raw)
            else:  # token ids
                p.echo = [self.backend.tokenizer.decode(ids) for ids in prompts]
        return p

    def _prepare_chat(self, body: ChatCompletionRequest, tenant: Tenant, pictures=None) -> Prepared:
        if body.user is not None:
            errors.check_text(body.user, "user")
        images = getattr(self.backend, "images", None)  # a vision-language model's ImageProcessor
        messages = chat_render.template_messages(body.messages, images=images is not None)
        tok = self.backend.tokenizer
        plan, messages, template_vars = tool_calling.plan(body, self.config.tools, tok, messages)
        prompt = chat_render.render(tok, messages, body, template_vars, self.config.allow_special_tokens)
        prompts = self._truncate([chat_image_prompt(images, prompt, pictures) if pictures else prompt], body)
        if body.top_logprobs is not None and not body.logprobs:
            raise errors.bad_request("top_logprobs: requires `logprobs: true`", "top_logprobs")
        field_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self._params(body, max_tokens, field_name, logprobs)
        if plan is not None:
            params.structured = checked(plan.constraint(body.tools, body.parallel_tool_calls is not False),
                                        tok) or params.structured
            if plan.choice == "auto" and self.config.tools.parser == "mistral":
                params.skip_special_tokens = False  # its [TOOL_CALLS] marker is a special token
        reserve = self._fit_context(prompts, params, "messages")
        thinking = None
        if self.config.reasoning_parser is not None:
            tail = tok.decode(prompts[0][-8:], skip_special_tokens=False)  # does the prompt open a think block?
            thinking = reasoning.plan(self.config.reasoning_parser, tail, constrained=params.structured is not None)
            if params.structured is not None:
                params.structured = reasoning.grammar_after_thinking(params.structured, tok, tail)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Prepared("chat", f"chatcmpl-{uuid.uuid4().hex}", model_names.answered_as(self.backend, body.model), tenant, prompts, params,
                        body.stream, include_usage, body.logprobs, reserve,
                        cache_salt=self.cache_salt(tenant, body.cache_salt), tools=plan,
                        prompt_logprobs=body.prompt_logprobs is not None, priority=_request_priority(body, tenant),
                        reasoning=thinking,
                        continuous_usage=include_usage and body.stream_options.continuous_usage_stats)

    # ------------------------------------------------------------------ admission

    async def admit(self, p: Prepared) -> None:
        """Reserve quota and a place in the queue, or raise the ApiError that says why not."""
        if self.scheduler is None or not self.backend.ready():
            raise errors.unavailable("No healthy workers are serving this model right now", "no_healthy_workers")
        q = p.tenant.quotas
        for name, limit in (("tokens_per_minute", q.tokens_per_minute), ("tokens_per_day", q.tokens_per_day)):
            if limit is not None and p.reserve > limit:
                raise errors.bad_request(
                    f"This request needs {p.reserve} tokens (prompt + max_tokens x n) but tenant "
                    f"{p.tenant.id!r} has a {name} quota of {limit}: lower max_tokens or n", "max_tokens",
                    "request_exceeds_quota")
        try:
            p.admission = await self.quota.admit(p.tenant.id, q, p.request_id, p.reserve)
        except QuotaExceeded as e:
            self.metrics.quota_rejections.labels(self.metrics.tenant(p.tenant.id), e.limit).inc()
            raise errors.rate_limited(
                f"Rate limit reached for tenant {p.tenant.id!r}: {e.limit} quota exhausted; retry after "
                f"{e.headers.get('Retry-After', '1')} s", e.limit, e.headers) from e
        except QuotaStoreBusy as e:
            raise errors.unavailable(f"The gateway is saturated: {e}", "quota_store_busy") from e
        except QuotaStoreUnavailable as e:
            log.error("%s", e)
            raise errors.unavailable("The quota store is unavailable; retry shortly", "quota_store_unavailable") from e
        try:
            p.ticket = self.scheduler.submit(p.tenant.id, p.tenant.priority, p.reserve,
                                             slots=p.params.n * len(p.prompts), rank=p.priority)
        except QueueFull as e:
            await self.quota.complete(p.admission, 0)
            raise errors.unavailable(f"The gateway is saturated: {e}", "queue_full") from e

    # ------------------------------------------------------------------ generation

    def request_timeout(self, tenant: Tenant) -> float | None:
        return request_timeout(self.config.request_timeout_s, tenant.request_timeout_s)

    def stream_outputs(self, p: Prepared):
        """(prompt index, RequestOutput) for every prompt of the request, interleaved."""
        if len(p.prompts) == 1:
            return _single(self.backend, p.prompts[0], p.params, p.request_id, p.engine_priority, p.cache_salt)
        return _merged(self.backend, p)


async def _single(backend, prompt, params, request_id, priority, cache_salt):
    gen = backend.generate(prompt, params, request_id, priority, cache_salt)
    try:
        async for out in gen:
            yield 0, out
    finally:
        await gen.aclose()


async def _merged(backend, p: Prepared):
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, prompt: list[int]) -> None:
        gen = backend.generate(prompt, p.params, f"{p.request_id}-{i}", p.engine_priority, p.cache_salt)
        try:
            async for out in gen:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, e))
        finally:
            await gen.aclose()

    tasks = [asyncio.create_task(pump(i, prompt)) for i, prompt in enumerate(p.prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _inline(body, chars: int) -> bool:
    """Whether a request is small and plain enough to prepare on the event loop (INLINE_PROMPT_CHARS)."""
    return chars <= INLINE_PROMPT_CHARS and body.model_fields_set <= _INLINE_FIELDS


def _request_priority(body, tenant: Tenant) -> int:
    """The request's priority, capped at what its tenant may ask for (so it cannot jump its own band)."""
    cap = tenant.max_request_priority
    return body.priority if cap is None else min(body.priority, cap)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's string keys as token ids; SamplingParams.validate checks them against the vocab."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise errors.bad_request(f"logit_bias: keys must be token ids, got {key[:32]!r}", "logit_bias")
        out[int(key)] = float(value)
    return out
