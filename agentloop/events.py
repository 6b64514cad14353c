"""The event catalog: every event class agentloop emits, and the hook decisions.

See ``docs/events.md`` for each event's kind, mode and fields.
"""

from ._bus import Lagged as Lagged
from ._events import ALL_EVENTS as ALL_EVENTS
from ._events import AgentCreated as AgentCreated
from ._events import AgentDisposed as AgentDisposed
from ._events import AgentHibernated as AgentHibernated
from ._events import AgentPreStep as AgentPreStep
from ._events import AgentRequest as AgentRequest
from ._events import AgentRequestError as AgentRequestError
from ._events import AgentSessionStart as AgentSessionStart
from ._events import AgentStatus as AgentStatus
from ._events import AgentStepResult as AgentStepResult
from ._events import AgentTurnContinuation as AgentTurnContinuation
from ._events import AgentTurnEnd as AgentTurnEnd
from ._events import AgentTurnStopping as AgentTurnStopping
from ._events import AgentWoken as AgentWoken
from ._events import Allow as Allow
from ._events import Ask as Ask
from ._events import Deny as Deny
from ._events import Event as Event
from ._events import HistoryCompacted as HistoryCompacted
from ._events import HistoryCompacting as HistoryCompacting
from ._events import InboxClaimed as InboxClaimed
from ._events import InboxDiscarded as InboxDiscarded
from ._events import InboxInserted as InboxInserted
from ._events import InboxSpliced as InboxSpliced
from ._events import InvariantViolated as InvariantViolated
from ._events import LlmRetry as LlmRetry
from ._events import LlmStream as LlmStream
from ._events import McpServerFailed as McpServerFailed
from ._events import PluginFailed as PluginFailed
from ._events import Reject as Reject
from ._events import Replace as Replace
from ._events import Retry as Retry
from ._events import SessionCreated as SessionCreated
from ._events import SessionDisposed as SessionDisposed
from ._events import SessionEventAppended as SessionEventAppended
from ._events import SessionFlush as SessionFlush
from ._events import SessionPersistenceFailed as SessionPersistenceFailed
from ._events import SettingChanged as SettingChanged
from ._events import Stop as Stop
from ._events import ToolApproval as ToolApproval
from ._events import ToolExecute as ToolExecute
from ._events import ToolPostExecute as ToolPostExecute
from ._events import ToolPreExecute as ToolPreExecute
from ._events import ToolProgress as ToolProgress
from ._events import ToolResultEvent as ToolResultEvent

__all__ = [
    "Event",
    "ALL_EVENTS",
    "Lagged",
    "SessionEventAppended",
    "SessionFlush",
    "SessionCreated",
    "SessionDisposed",
    "SessionPersistenceFailed",
    "AgentCreated",
    "AgentSessionStart",
    "AgentDisposed",
    "AgentStatus",
    "AgentHibernated",
    "AgentWoken",
    "InboxSpliced",
    "InboxInserted",
    "InboxDiscarded",
    "InboxClaimed",
    "LlmRetry",
    "PluginFailed",
    "SettingChanged",
    "InvariantViolated",
    "McpServerFailed",
    "AgentPreStep",
    "AgentRequest",
    "AgentRequestError",
    "AgentStepResult",
    "AgentTurnContinuation",
    "AgentTurnStopping",
    "AgentTurnEnd",
    "LlmStream",
    "ToolPreExecute",
    "ToolApproval",
    "ToolExecute",
    "ToolPostExecute",
    "ToolResultEvent",
    "HistoryCompacting",
    "HistoryCompacted",
    "ToolProgress",
    "Reject",
    "Replace",
    "Stop",
    "Retry",
    "Deny",
    "Ask",
    "Allow",
]
