"""The Responses API's tool shapes beyond `function` and `custom`, as the chat request's tools: what goes into the
prompt under which name, and how a call the model writes goes back out.

- `namespace` (`{"type": "namespace", "name": "multi_agent_v1", "tools": [...]}`, which Codex sends): its function
  and custom tools join the prompt as `<namespace>__<name>`, a name the model can write back in every tool-call
  format; a call to one comes back with the bare `name` and `namespace` set, and a replayed call item with a
  `namespace` is rendered under the same joined name.
- `tool_search` with `execution: "client"`: offered to the model as a function `tool_search` with the tool's own
  parameters; a call to it comes back as a `tool_search_call` item (`call_id`, `execution`, `arguments` as an
  object). A `tool_search_output` input item's `tools` (functions and namespaces) join the prompt from then on.
  With `execution: "server"` it is a hosted tool.
- Any other type (the hosted tools, and types this server does not know) is left out of the prompt and reported in
  `left_out` (counted in openarc_ignored_tools_total and logged once per type); only a `tool_choice` that forces
  such a tool is a 400 saying why.

Pure functions over the request's JSON; appliance.front.api.responses calls them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from appliance.front.api.errors import InvalidRequest
from appliance.front.api.tools import FUNCTION_NAME, HOSTED_TOOL_TYPES

NAMESPACE_SEPARATOR = "__"
TOOL_SEARCH = "tool_search"  # the tool type, and the function name the model sees for it
SERVED_TYPES = ("function", "custom")


def joined_name(namespace: str | None, name: Any) -> Any:
    """The name the model sees for a namespace's tool (the bare name outside a namespace)."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace and isinstance(name, str) else name


@dataclass
class ToolNames:
    """What each name the model may call stands for in the Responses API."""

    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # joined name -> (namespace, bare name)
    tool_search: bool = False  # a client tool_search is offered (as the function TOOL_SEARCH)

    def call_item(self, name: str) -> dict[str, Any]:
        """The fields a call item to `name` carries: its bare name and namespace, or {} for a plain tool."""
        if name in self.namespaced:
            namespace, bare = self.namespaced[name]
            return {"name": bare, "namespace": namespace}
        return {}

    def is_tool_search(self, name: str) -> bool:
        return self.tool_search and name == TOOL_SEARCH


@dataclass
class FlatTools:
    """A Responses `tools` list as the flat list of function and custom tools the chat checks take. Each flat tool
    keeps where the request has it (`tools[1]`, `tools[0].tools[2]`, `input[3].tools[0]`): the checks see only the
    flat list, and a refusal must name the client's own field."""

    tools: list[Any] = field(default_factory=list)       # Responses-shaped function / custom tools (names joined)
    loaded: list[Any] = field(default_factory=list)      # the same, loaded by the input's tool_search_output items
    origins: dict[int, str] = field(default_factory=dict)  # id() of a flat tool -> where the request has it
    owners: dict[str, tuple[tuple[str | None, str], str]] = field(default_factory=dict)  # name -> (tool, where)
    names: ToolNames = field(default_factory=ToolNames)
    left_out: dict[str, str] = field(default_factory=dict)  # a left-out tool's name (or its type) -> its type
    echo: list[Any] = field(default_factory=list)        # the tools served, as the response object repeats them
    skipped: list[str] = field(default_factory=list)     # the types of the input items skipped (counted)

    @property
    def all(self) -> list[Any]:
        """Every tool the prompt offers, each name once: the request's, then those loaded (so the request's keep
        their place). A tool loaded again (a second search finding it, or one the request already carries) is
        the one offered already: the history replays every search, so a duplicate cannot be the client's error."""
        offered, names = list(self.tools), {_name(tool) for tool in self.tools}
        for tool in self.loaded:
            if _name(tool) is None or _name(tool) not in names:
                offered.append(tool)
                names.add(_name(tool))
        return offered

    def where(self, tool: Any) -> str:
        return self.origins[id(tool)]

    def add(self, tools: Any, where: str, loaded: bool = False) -> list[Any]:
        """Flatten `tools` (the request's `tools`, or a tool_search_output's when `loaded`) into this list; the
        function and custom tools they gave."""
        target = self.loaded if loaded else self.tools
        before = len(target)
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            served = True
            if kind == "namespace":
                self._namespace(tool, f"{where}[{i}]", target)
            elif kind == TOOL_SEARCH and tool.get("execution", "server") == "client":
                self._offer(target, self._tool_search(tool), f"{where}[{i}]")
            elif kind in SERVED_TYPES or not isinstance(kind, str):
                self._offer(target, tool, f"{where}[{i}]")  # checked (and refused if malformed) by the chat checks
            else:  # a hosted tool, a server-side tool_search, or a type this server does not know
                self.left_out[str(tool.get("name") or kind)] = kind
                served = False
            if served and not loaded:
                self.echo.append(tool)
        return target[before:]

    def _offer(self, target: list[Any], tool: Any, where: str, namespace: str | None = None) -> None:
        """Add a flat tool; a name the model would see for two different tools (a namespace's joined name that is
        also a plain tool's, or another namespace's) is refused naming both places."""
        name = _name(tool)
        if name is not None:
            owner = (namespace, name)  # the joined name, with the namespace it came from (None: a plain tool)
            seen = self.owners.setdefault(name, (owner, where))
            if seen[0] != owner:
                raise InvalidRequest(f"'{where}.name': {name!r} is the name the model sees for this tool and for "
                                     f"'{seen[1]}' (a namespace's tools are offered as "
                                     f"<namespace>{NAMESPACE_SEPARATOR}<name>): rename one", f"{where}.name")
        target.append(tool)
        self.origins[id(tool)] = where

    def _namespace(self, tool: dict, where: str, target: list[Any]) -> None:
        namespace, members = tool.get("name"), tool.get("tools")
        if not isinstance(namespace, str) or not namespace or not isinstance(members, list):
            raise InvalidRequest(f"'{where}' must be {{\"type\": \"namespace\", \"name\": ..., \"tools\": [...]}}",
                                 where)
        if not FUNCTION_NAME.match(namespace):
            raise InvalidRequest(f"'{where}.name' must be 1-128 letters, digits, '_', '.' or '-'", f"{where}.name")
        for j, member in enumerate(members):
            kind = member.get("type") if isinstance(member, dict) else None
            if kind not in SERVED_TYPES:
                self.left_out[f"{namespace}.{member.get('name') if isinstance(member, dict) else j}"] = str(kind)
                continue
            if not isinstance(member.get("name"), str):
                raise InvalidRequest(f"'{where}.tools[{j}].name' must be a string", f"{where}.tools[{j}].name")
            name = joined_name(namespace, member["name"])
            self._offer(target, {**member, "name": name}, f"{where}.tools[{j}]", namespace)
            self.names.namespaced.setdefault(name, (namespace, member["name"]))

    def _tool_search(self, tool: dict) -> dict[str, Any]:
        self.names.tool_search = True
        function = {"type": "function", "name": TOOL_SEARCH, "strict": False,
                    "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description"):
            function["description"] = tool["description"]
        return function

    def choice(self, choice: Any) -> Any:
        """tool_choice with a namespaced function named by its joined name; a choice forcing a tool this server
        cannot run is a 400 saying why."""
        if not isinstance(choice, dict):
            return choice
        kind = choice.get("type")
        if kind in SERVED_TYPES:
            return {**choice, "name": joined_name(choice.get("namespace"), choice.get("name"))}
        if kind == TOOL_SEARCH and self.names.tool_search:
            return {"type": "function", "name": TOOL_SEARCH}
        if kind in HOSTED_TOOL_TYPES or kind in self.left_out.values() or kind == TOOL_SEARCH:
            raise InvalidRequest(f"'tool_choice' forces a tool of type {kind!r}, which this server cannot run (it "
                                 f"leaves such tools out of the prompt): force a function or custom tool, or use "
                                 f"auto", "tool_choice")
        return choice


def _name(tool: Any) -> str | None:
    name = tool.get("name") if isinstance(tool, dict) else None
    return name if isinstance(name, str) else None
