"""The public surface is frozen: adding or removing a name must be a conscious change."""

import agentloop
import agentloop.events
import agentloop.llm
import agentloop.testing
import agentloop.testing.strategies

EXPECTED = {
    agentloop: {
        "open_agent", "tool", "open_runtime", "Context", "Config", "AgentConfig", "ProviderConfig",
        "report_progress",
        "PersistenceConfig", "Agent", "AgentHandle", "AgentOptions", "Inbox", "InboxMessage",
        "MessageId", "Session", "SessionEvent", "Message", "ToolCall", "CallConfig", "Tool",
        "ToolSpec", "ToolResult", "truncate_content", "FrozenDict", "Disposer", "Lagged",
        "Allow", "Ask", "Deny", "Reject", "Replace", "Stop", "Retry", "SessionPersistence",
        "SessionInfo",
        "StoredSession", "AgentLoopError", "ConfigError", "SettingsError", "InvalidContent",
        "ProviderError", "SessionIdInUse", "SessionLeased", "ScopeClosed", "InvalidOptions",
        "SessionNotFound", "PersistenceUnavailable",
        "PersistenceError", "AgentDisposed", "AgentNotPublished", "RuntimeClosed",
        "ToolDefinitionError", "TurnFailed", "Run", "RunResult", "PendingApproval",
        "SubagentLimitExceeded", "Job", "JobCancelled", "JobFailed", "TreeEvent",
        "Plugin", "thaw", "validate_session_id", "load_config", "content_text",
    },
    agentloop.testing: {
        "ScriptedModel", "FunctionModel", "Reply", "reply", "TextDelta", "ReasoningDelta",
        "ToolCallDelta", "Finish", "ProviderError",
        "TestModel", "example_arguments", "block_network", "check_log", "check_history",
        "check_inbox", "record_events", "run_race", "Race", "Operation", "RaceModel",
        "register_race_tools", "check_persistence_backend", "record_stream", "replay_stream",
        "Recording", "Exchange",
        "LoopbackServer",
    },
    agentloop.testing.strategies: {
        "operations", "model_scripts", "OPERATION_KINDS", "run_race", "Race", "Operation",
        "Followup", "Steer", "Inject", "Edit", "Remove", "Cancel", "Close", "CreateSameId",
        "WriteSetting", "Advance", "Settle", "Spawn", "Exit",
        "Behaviour", "Say", "Think", "CallTools", "Fail", "Stall", "MaxTokens",
        # The race kit's search (issue 33): scheduler seeds, weights and patterns, operations
        # that land mid-turn, approvals, crash and resume, slow hooks and subscribers.
        "seeds", "DEFAULT_KINDS", "WEIGHTS", "POINTS", "HOOK_POINTS", "DEFAULT_TOOLS",
        "DEFAULT_SCRIPT", "Instant", "Approve", "Deny", "Together", "When", "Resume",
        "Subscribe", "Crash", "Hold",
        # Hibernation (issue 26).
        "Hibernate", "Wake",
    },
    agentloop.llm: {
        "OpenAIChatAdapter", "OpenAIResponsesAdapter", "AnthropicAdapter", "ModelAdapter",
        "AdapterDefaults", "LLMRequest", "TextDelta", "ReasoningDelta", "ToolCallDelta", "Finish",
        "ProviderError", "RetryPolicy", "is_retryable",
    },
    agentloop.events: {
        "Event", "ALL_EVENTS", "Lagged", "SessionEventAppended", "SessionFlush",
        "SessionCreated", "SessionDisposed", "SessionPersistenceFailed", "AgentCreated",
        "AgentSessionStart",
        "AgentDisposed", "AgentStatus", "AgentHibernated", "AgentWoken", "InboxSpliced",
        "InboxInserted", "InboxDiscarded",
        "InboxClaimed", "LlmRetry", "PluginFailed", "SettingChanged", "InvariantViolated",
        "McpServerFailed", "AgentPreStep",
        "AgentRequest", "AgentRequestError", "AgentStepResult", "AgentTurnContinuation",
        "AgentTurnEnd", "AgentTurnStopping", "LlmStream", "ToolPreExecute", "ToolApproval",
        "ToolExecute", "ToolPostExecute", "ToolResultEvent", "Reject", "Replace", "Stop",
        "Retry", "Deny", "Ask", "Allow",
        # control for services: compaction hooks, tool progress
        "HistoryCompacting", "HistoryCompacted", "ToolProgress",
    },
}


def test_public_names_are_frozen() -> None:
    for module, names in EXPECTED.items():
        assert set(module.__all__) == names, module.__name__
        for name in names:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_every_public_exception_is_an_agentloop_error() -> None:
    for name in agentloop.__all__:
        obj = getattr(agentloop, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            assert issubclass(obj, agentloop.AgentLoopError), name


def test_public_value_types_are_frozen_attrs() -> None:
    import attrs

    for cls in (agentloop.AgentOptions, agentloop.SessionEvent, agentloop.Message,
                agentloop.ToolCall, agentloop.InboxMessage, agentloop.CallConfig,
                agentloop.ToolSpec, agentloop.ToolResult, agentloop.Tool, agentloop.Inbox,
                agentloop.RunResult, agentloop.PendingApproval):
        assert attrs.has(cls), cls
        inst_fields = attrs.fields(cls)
        assert inst_fields, cls
        assert cls.__setattr__ is not object.__setattr__, f"{cls.__name__} is not frozen"
