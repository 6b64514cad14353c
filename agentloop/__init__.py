"""agentloop: an actor-model runtime for LLM agents on trio structured concurrency.

Embed it in any trio program::

    async with agentloop.open_runtime() as rt:
        rt.llm.register("scripted", ScriptedModel(["Hello!"]))
        handle = await rt.agents.create(
            session_id="s1", agent_options=agentloop.AgentOptions(provider="scripted", model="m")
        )
        async with handle:
            handle.agent.followup("hi")
            await handle.agent.wait_idle()

Layering (``tests/test_layering.py`` enforces it; a module imports its own layer or lower)::

    app         _cli*, __main__          the command line, on the public API only
    public      this module, events, testing, _catalog, _front (open_agent)
    runtime     _runtime                 open_runtime, plugin actors, shutdown order
    plugin      _plugin                  the Plugin protocol
    context     _context                 Context and the ctx.* facades
    supervisor  _agents _subagents       the supervisor actor, creation, handles; sub-agents, jobs
    driver      _agent                   the agent actor: admission, run controls, turns
    parts       _inbox _reply _run _scheduler _request _lifecycle _approvals _tail
                                         input; one reply; run handles; tools; one step's
                                         request; publication to quiescence; approvals; tails
    services    _services _session _llm _tools _settings _persistence _config _output _inputs
                                         the services record handed down; log, models, tools
    bus         _bus _schema _pydantic _limits _progress _report
                                         events; schemas; pydantic models; shared call
                                         limits; tool progress
    values      _log _events _model _json _frozen _errors _http _util _prices
    llm/        the adapters, over values only; plugins/ use the public modules only

A lower layer that must name a higher type declares a ``Protocol`` of its own (``_run.Driven``,
``_agents.Scope``); no import circle, type-only imports included.
"""

from ._agent import Agent as Agent
from ._agents import AgentHandle as AgentHandle
from ._agents import SubagentLimitExceeded as SubagentLimitExceeded
from ._bus import Disposer as Disposer
from ._bus import Lagged as Lagged
from ._config import AgentConfig as AgentConfig
from ._config import Config as Config
from ._config import PersistenceConfig as PersistenceConfig
from ._config import ProviderConfig as ProviderConfig
from ._config import load_config as load_config
from ._context import Context as Context
from ._errors import AgentDisposed as AgentDisposed
from ._errors import AgentLoopError as AgentLoopError
from ._errors import AgentNotPublished as AgentNotPublished
from ._errors import ConfigError as ConfigError
from ._errors import InvalidContent as InvalidContent
from ._errors import InvalidOptions as InvalidOptions
from ._errors import PersistenceError as PersistenceError
from ._errors import PersistenceUnavailable as PersistenceUnavailable
from ._errors import ProviderError as ProviderError
from ._errors import RuntimeClosed as RuntimeClosed
from ._errors import ScopeClosed as ScopeClosed
from ._errors import SessionIdInUse as SessionIdInUse
from ._errors import SessionLeased as SessionLeased
from ._errors import SessionNotFound as SessionNotFound
from ._errors import SettingsError as SettingsError
from ._errors import ToolDefinitionError as ToolDefinitionError
from ._errors import TurnFailed as TurnFailed
from ._events import Allow as Allow
from ._events import Ask as Ask
from ._events import Deny as Deny
from ._events import Reject as Reject
from ._events import Replace as Replace
from ._events import Retry as Retry
from ._events import Stop as Stop
from ._front import open_agent as open_agent
from ._inbox import Inbox as Inbox
from ._json import FrozenDict as FrozenDict
from ._json import thaw as thaw
from ._model import AgentOptions as AgentOptions
from ._model import CallConfig as CallConfig
from ._model import InboxMessage as InboxMessage
from ._model import Message as Message
from ._model import MessageId as MessageId
from ._model import PendingApproval as PendingApproval
from ._model import SessionEvent as SessionEvent
from ._model import ToolCall as ToolCall
from ._model import ToolResult as ToolResult
from ._model import ToolSpec as ToolSpec
from ._model import content_text as content_text
from ._persistence import SessionInfo as SessionInfo
from ._persistence import SessionPersistence as SessionPersistence
from ._persistence import StoredSession as StoredSession
from ._plugin import Plugin as Plugin
from ._report import report_progress as report_progress
from ._run import Run as Run
from ._run import RunResult as RunResult
from ._runtime import open_runtime as open_runtime
from ._session import Session as Session
from ._session import validate_session_id as validate_session_id
from ._subagents import Job as Job
from ._subagents import JobCancelled as JobCancelled
from ._subagents import JobFailed as JobFailed
from ._subagents import TreeEvent as TreeEvent
from ._tools import Tool as Tool
from ._tools import tool as tool
from ._tools import truncate_content as truncate_content
from ._util import fixup_module_metadata as _fixup_module_metadata

__version__ = "0.1.0"

_fixup_module_metadata(__name__, globals())

__all__ = [
    "open_agent",
    "open_runtime",
    "tool",
    "report_progress",
    "Context",
    "Config",
    "AgentConfig",
    "ProviderConfig",
    "PersistenceConfig",
    "Agent",
    "AgentHandle",
    "AgentOptions",
    "Run",
    "RunResult",
    "Inbox",
    "InboxMessage",
    "MessageId",
    "Session",
    "SessionEvent",
    "Message",
    "ToolCall",
    "CallConfig",
    "Tool",
    "ToolSpec",
    "ToolResult",
    "PendingApproval",
    "truncate_content",
    "FrozenDict",
    "Disposer",
    "Lagged",
    "Allow",
    "Ask",
    "Deny",
    "Reject",
    "Replace",
    "Retry",
    "Stop",
    "SessionPersistence",
    "SessionInfo",
    "StoredSession",
    "AgentLoopError",
    "ConfigError",
    "SettingsError",
    "InvalidContent",
    "ProviderError",
    "SessionIdInUse",
    "SessionLeased",
    "ScopeClosed",
    "InvalidOptions",
    "SessionNotFound",
    "PersistenceUnavailable",
    "PersistenceError",
    "AgentDisposed",
    "AgentNotPublished",
    "RuntimeClosed",
    "ToolDefinitionError",
    "TurnFailed",
    "SubagentLimitExceeded",
    "Job",
    "JobCancelled",
    "JobFailed",
    "TreeEvent",
    "Plugin",
    "thaw",
    "validate_session_id",
    "load_config",
    "content_text",
]
