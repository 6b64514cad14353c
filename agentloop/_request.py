"""One step's model call: the request assembled (system prompt, tools, history, config), the
``agent/request`` waterfall, the call with its retries and fallbacks, and the reply folded.

:class:`Requests` owns what an agent carries from one step's request to the next: the call
config the next step proposes, the tool specs it last built, and the messages last sent on each
route (for ``request/header``'s ``cache_prefix``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import trio

from . import _log
from ._errors import ProviderError
from ._events import AgentRequest, AgentRequestError, AgentStepResult, Retry, _Outcome
from ._json import FrozenDict, freeze_repaired
from ._limits import UNLIMITED
from ._model import CallConfig, LLMRequest, Message, ToolSpec
from ._output import OutputSpec, refuses_schema
from ._output import check as check_output
from ._reply import StepOutcome, fold_stream
from ._util import stored_maker

if TYPE_CHECKING:
    from ._llm import PreparedCall
    from ._services import Services
    from ._session import Session

__all__ = ["Requests"]

# LLMRequest(system, messages, tools, config, session_id, turn, step, output_schema,
# output_name): one a step.
_request_of = stored_maker(LLMRequest)

Route = tuple[str | None, str | None]


@attrs.define(slots=True, eq=False)
class _Planned:
    """One step's request as the hooks left it, before the call (and its retries)."""

    config: CallConfig
    system: str
    template: str
    templated: bool  # the system prompt follows the route (a fallback renders it again)
    messages: Sequence[Message]
    history: Sequence[Message]
    specs: tuple[ToolSpec, ...]


class Requests:
    """The model calls of one agent, step after step."""

    __slots__ = ("_agent_id", "_config", "_config_json", "_cwd", "_proposal", "_sent",
                 "_services", "_session", "_specs", "_specs_version", "_system",
                 "_system_prompt")

    def __init__(
        self, services: Services, session: Session, proposal: CallConfig, *,
        system_prompt: str | None, cwd: str | None,
    ) -> None:
        self._services = services
        self._session = session
        self._agent_id = session.id
        self._proposal = proposal
        self._system_prompt = system_prompt
        self._cwd = cwd
        self._specs_version = -1
        self._specs: tuple[ToolSpec, ...] = ()
        # The messages of the latest request sent on each route, for request/header's
        # cache_prefix (a snapshot: O(1) to keep and, unless replaced, to compare).
        self._sent: dict[Route, Sequence[Message]] | None = None  # made by the first call
        # The last call's config and its JSON (a turn's steps mostly send the same config):
        # two fields rather than a tuple, the JSON shared between agents (_config_json).
        self._config: CallConfig | None = None
        self._config_json: FrozenDict | None = None
        # (template, config, the system prompt rendered from them, whether it has fields).
        self._system: tuple[str, CallConfig, str, bool] | None = None

    @property
    def proposal(self) -> CallConfig:
        """The call settings the next step proposes (what a hibernating agent keeps)."""
        return self._proposal

    def _visible_specs(self) -> tuple[ToolSpec, ...]:
        registry = self._services.tools
        if registry.version != self._specs_version:
            self._specs = registry.specs(self._agent_id)
            self._specs_version = registry.version
        return self._specs

    def _json_of(self, config: CallConfig) -> FrozenDict:
        found = self._config_json
        if found is None or self._config is not config:
            found = self._config_json = _config_json(config)
            self._config = config
        return found

    def _render(self, template: str, config: CallConfig) -> str:
        return self._services.prompt.render(
            template, provider=config.provider, model=config.model, cwd=self._cwd
        )

    async def step(self, turn: int, step: int, spec: OutputSpec | None) -> StepOutcome:
        """Make this step's model call and fold its reply into the log."""
        planned = self._proposed()
        if self._services.bus.has_handlers(AgentRequest):
            await self._rewrite(planned, turn, step)
        # The call, made again as long as ``agent/request-error`` asks for a retry: in this
        # frame, one level less in the chain every suspension of the step passes through.
        bus, config = self._services.bus, planned.config
        # Per route (provider, model): a call moved to another route counts from 1 there.
        # Its keys, in the order first tried, are the routes an error handler is told of.
        # Made by the first failure: most calls succeed at once, as attempt 1.
        tries: dict[Route, int] | None = None
        after: FrozenDict | None = None
        while True:
            if tries is None:
                attempt = 1
            else:
                key = (config.provider, config.model)
                attempt = tries[key] = tries.get(key, 0) + 1
            prepared: PreparedCall | None = None
            try:
                _check_route(config)
                # The call's cancellation point (LLMService.prepare_call's), in this frame.
                await trio.lowlevel.checkpoint_if_cancelled()
                prepared = self._services.llm.prepare_now(config)
                outcome = await self._attempt(turn, step, planned, config, prepared, spec, after)
                break
            except ProviderError as err:
                failure = err
            if tries is None:
                tries = {(config.provider, config.model): 1}
            if spec is not None and prepared is not None and prepared.native_output and (
                refuses_schema(failure)
            ):
                # Once per route: the call is made again at once, offering the final_result
                # tool, and so is every later call on this route.
                prepared.refused_json_schema()
                after = self._failed(config, attempt, failure)
                continue
            # Recovery runs outside the except block: a retry wait must not chain onto (or,
            # when cancelled, discard) the provider error.
            decision = None
            if bus.has_handlers(AgentRequestError):
                decision = await bus.emit(
                    AgentRequestError(
                        self._agent_id, turn, step, attempt, config, failure,
                        prepared.retry if prepared is not None else None,
                        tuple(f"{provider}:{model}" for provider, model in tries),
                    )
                )
            if not isinstance(decision, Retry):
                raise failure
            after = self._failed(config, attempt, failure)
            if decision.config is not None:
                config = decision.config
            # A handler that retries at once must still let other tasks (and cancel()) in.
            await trio.lowlevel.checkpoint()
        assert prepared is not None  # the loop ends only on a reply
        if config is not planned.config:
            # A call moved to another route (a fallback) serves this step only.
            self._proposal = planned.config
        # Adapter-filled fields are dropped, so the next step's route fills its own.
        elif prepared.adapter_defaults:
            self._proposal = attrs.evolve(
                prepared.config, **dict.fromkeys(prepared.adapter_defaults)
            )
        else:
            self._proposal = prepared.config
        if bus.has_listeners(AgentStepResult):
            await bus.emit(
                AgentStepResult(
                    self._agent_id, turn, step, outcome.finish_reason, outcome.text,
                    outcome.tool_calls,
                )
            )
        return outcome

    def _proposed(self) -> _Planned:
        """The request the step proposes."""
        config = self._proposal
        template = self._services.prompt.template_for(self._agent_id, self._system_prompt)
        # A turn's steps mostly render the same template for the same config: kept, with
        # whether the template has fields, until either changes (rendering is pure).
        system = self._system
        if system is None or system[0] is not template or system[1] is not config:
            system = self._system = (
                template, config, self._render(template, config), "{" in template
            )
        history = self._session.messages()
        return _Planned(
            config, system[2], template, system[3], history, history, self._visible_specs()
        )

    async def _rewrite(self, planned: _Planned, turn: int, step: int) -> None:
        """``planned`` as the ``agent/request`` waterfall leaves it."""
        config, system, history, specs = (
            planned.config, planned.system, planned.history, planned.specs
        )
        template = planned.template
        outcome_of = _Outcome()
        proposed = AgentRequest(
            self._agent_id, turn, step, config, system, specs, history, outcome_of
        )
        planned.config = await self._services.bus.emit(proposed)
        final = outcome_of.event
        if final is None or final.config is not planned.config:
            # Only the waterfall's own last copy says what the handlers left.
            final = attrs.evolve(proposed, config=planned.config)
        planned.messages, planned.specs = final.messages, final.tools
        if final.system != system:
            planned.system = final.system
            planned.templated = False
        elif planned.templated:
            planned.system = self._render(template, planned.config)

    @staticmethod
    def _failed(config: CallConfig, attempt: int, failure: ProviderError) -> FrozenDict:
        """The next header records the failed call, so the log keeps every attempt."""
        error = freeze_repaired(failure.to_json())[0]
        assert isinstance(error, FrozenDict)
        return _log.failed_call(config.provider, config.model, attempt, error)

    async def _attempt(
        self, turn: int, step: int, planned: _Planned, config: CallConfig,
        prepared: PreparedCall, spec: OutputSpec | None, after: FrozenDict | None,
    ) -> StepOutcome:
        system = planned.system
        if planned.templated and config is not planned.config:
            system = self._render(planned.template, config)
        session, messages = self._session, planned.messages
        effective = prepared.config
        route = (effective.provider, effective.model)
        sent = self._sent
        if sent is None:
            sent = self._sent = {}
        before = sent.get(route)
        # The slot is held from the header until the reply is folded; the wait for it shows
        # in the header, and a cancel while waiting takes no slot.
        limits = self._services.limits
        # Most runtimes limit no route: no coroutine for a slot that is never waited for.
        release, queued = await limits.acquire(route[0], route[1]) if limits else UNLIMITED
        try:
            # One frame with the wait for the slot: the step's await chain, which every
            # suspension and resumption of the actor passes through, is a level shorter.
            session.append_request_header(
                turn, step, self._json_of(effective), prepared.adapter_defaults, len(messages),
                0 if before is None else session.common_prefix(before, messages),
                messages is not planned.history, after, queued,
            )
            sent[route] = messages
            native = spec is not None and prepared.native_output
            request = _request_of(
                system,
                messages,
                planned.specs if spec is None or native else (*planned.specs, spec.tool()),
                effective,
                self._agent_id,  # session_id
                turn,
                step,
                spec.schema if spec is not None and native else None,  # output_schema
                spec.name if spec is not None else "output",  # output_name
            )
            served = prepared.serve_now(request)
            if served is None:  # an llm/stream handler may serve it
                served = await prepared.serve(request, agent_id=self._agent_id)
            stream, guard = served
            judge = None if spec is None else functools.partial(check_output, spec, native)
            prices = self._services.prices
            cost = None if not prices.prices else functools.partial(
                prices.priced, effective.provider, effective.model
            )
            return await fold_stream(
                session, turn, step, stream, judge, failure=guard, cost=cost
            )
        finally:
            release()


# The JSON of the last call config a header recorded. Agents made from one options object
# share its config, and every step's header records it: one frozen copy serves them all,
# where each agent kept its own. Weakly held, and dropped with its config: a module-level
# memo must not keep a runtime's objects alive after the runtime is gone.
_last_config: weakref.ref[CallConfig] | None = None
_last_config_json: FrozenDict | None = None


def _config_json(config: CallConfig) -> FrozenDict:
    global _last_config, _last_config_json
    last, found = _last_config, _last_config_json
    if last is not None and found is not None and last() is config:
        return found
    found = config.to_json()
    _last_config, _last_config_json = weakref.ref(config, _forget_config), found
    return found


def _forget_config(ref: weakref.ref[CallConfig]) -> None:
    global _last_config, _last_config_json
    if _last_config is ref:
        _last_config = _last_config_json = None


def _check_route(config: CallConfig) -> None:
    if not config.provider or not config.model:
        raise ProviderError(
            f"a model call needs a provider and a model; got provider="
            f"{config.provider!r}, model={config.model!r}",
            code="INVALID_CONFIG",
        )
