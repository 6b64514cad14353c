"""The opt-in compiled build: hatch-mypyc, fitted to this project's layout.

Enabled with ``HATCH_BUILD_HOOK_ENABLE_CUSTOM=1`` (see pyproject.toml); otherwise hatchling
never loads this file and the wheel is pure Python. An editable install is pure either way.

hatch-mypyc compiles relative to the first of the wheel's source folders, which here is
``plugins/`` (the plugin packages live there), while the modules it compiles are in
``agentloop/`` at the root: so the compile runs from the root. mypyc writes its extension
modules beside the sources; once they are in the wheel they are removed again, so a
checkout the wheel was built from keeps importing its own ``.py`` files.
"""

from __future__ import annotations

from typing import Any

from hatch_mypyc.plugin import MypycBuildHook


class CompiledBuild(MypycBuildHook):  # type: ignore[misc]
    @property
    def package_source(self) -> str:
        return ""

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        # An editable install runs the checkout's own files: compiled ones would hide edits.
        if version != "editable":
            super().initialize(version, build_data)

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        if self.target_name == "wheel" and version != "editable":
            self.clean([version])


def get_build_hook() -> type[CompiledBuild]:
    return CompiledBuild
