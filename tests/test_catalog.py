"""The event catalog: well-formed event classes and a checked-in docs/events.md that matches."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

import agentloop._log
import agentloop.events
from agentloop._catalog import main, render_catalog
from agentloop._events import ALL_EVENTS

# This checkout's page, wherever the package under test was installed from.
DOCS_PATH = Path(__file__).resolve().parents[1] / "docs" / "events.md"

KINDS = ("durable", "control", "hook")
MODES = ("notify", "waterfall", "decision")


def test_docs_events_md_is_up_to_date() -> None:
    if not agentloop._log.__file__.endswith(".py"):
        pytest.skip("agentloop._log is compiled (mypyc), whose TypedDicts keep no field types "
                    "to render: the page is rendered from the pure modules")
    assert DOCS_PATH.exists(), f"{DOCS_PATH} is missing: run `python -m agentloop._catalog`"
    checked_in = DOCS_PATH.read_text(encoding="utf-8")
    assert checked_in == render_catalog(), (
        "docs/events.md is stale: run `python -m agentloop._catalog` and commit the result"
    )


@pytest.mark.parametrize("cls", ALL_EVENTS, ids=lambda cls: cls.__name__)
def test_event_class_is_well_formed(cls: type[agentloop.events.Event]) -> None:
    assert "/" in cls.name
    assert cls.kind in KINDS
    assert cls.mode in MODES
    assert attrs.has(cls)
    # The catalog names every class as agentloop.events.<Name>.
    assert getattr(agentloop.events, cls.__name__) is cls
    if cls.kind != "hook":
        assert cls.mode == "notify", "only hooks are awaited, so only hooks return values"


def test_event_names_are_unique() -> None:
    names = [cls.name for cls in ALL_EVENTS]
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("cls", ALL_EVENTS, ids=lambda cls: cls.__name__)
def test_waterfall_field_names_an_attrs_field(cls: type[agentloop.events.Event]) -> None:
    if cls.mode == "waterfall":
        assert cls.waterfall_field in attrs.fields_dict(cls)  # type: ignore[arg-type]
    else:
        assert cls.waterfall_field is None


def test_every_event_is_in_the_catalog() -> None:
    text = render_catalog()
    for cls in ALL_EVENTS:
        assert f"### `{cls.name}`" in text
        assert f"`agentloop.events.{cls.__name__}`" in text


def test_check_reports_a_stale_or_missing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "docs" / "events.md"
    assert main(["--check"], path=path) == 1
    assert "missing" in capsys.readouterr().err

    assert main([], path=path) == 0
    assert path.read_text(encoding="utf-8") == render_catalog()
    assert main(["--check"], path=path) == 0

    path.write_text(render_catalog() + "edited by hand\n", encoding="utf-8")
    assert main(["--check"], path=path) == 1
    assert "python -m agentloop._catalog" in capsys.readouterr().err


def test_every_durable_log_type_is_in_the_catalog_with_its_keys() -> None:
    from agentloop import _log
    from agentloop._catalog import render_catalog

    written = {v for k, v in vars(_log).items() if k.isupper() and isinstance(v, str)
               and "/" in v}
    listed = {type_ for type_, _, _ in _log.SCHEMA}
    assert written == listed, written ^ listed
    catalog = render_catalog()
    for type_, payload, _ in _log.SCHEMA:
        assert f"### `{type_}`" in catalog
        for key in payload.__annotations__:
            assert f"| `{key}` |" in catalog, (type_, key)
