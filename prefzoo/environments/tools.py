"""Tools the policy can call between its turns: their schemas, how a call is written and parsed, and how it is run.

**Schemas.** A tool is a Python callable with type hints and a Google-style docstring (an ``Args:`` line per argument),
as TRL 1.16's ``tools=[...]`` and ``environment_factory`` ask; its JSON schema is ``transformers``'
``get_json_schema`` (the form chat templates take as ``tools=``).

**The call format.** A tokenizer whose chat template renders ``tools`` (Qwen's, Llama 3.1's, ...) gets the schemas
through the template and its calls are read with ``tokenizer.parse_response`` when it carries a
``response_template`` (transformers >= 5.13). A template without tool support -- SmolLM2-135M-Instruct's -- gets
prefzoo's default format: the tools described in a system message (:func:`default_tools_message`) and each call
written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Hermes/Qwen convention), read by the same
``parse_response`` with :data:`DEFAULT_RESPONSE_TEMPLATE`, a response template of transformers' own format.

**Running a call** (:func:`call_tool`): an unknown name, arguments that are not an object or do not fit the signature,
a tool that raises, returns something other than a string or a number, or runs past ``timeout`` seconds each give an
error observation the policy reads (``{"error": ...}`` as text, TRL's form) and count as a failed call; the episode
goes on. "Raises" means anything but a Ctrl-C: a tool that calls ``sys.exit()`` is a failed call too (TRL catches
``Exception`` only, and such a tool would end its run).

**Timeouts.** Each call runs in a daemon thread of its own. One that runs past ``env.tool_timeout`` is answered at the
timeout and then stopped: :class:`ToolStopped` is raised inside it (CPython's per-thread asynchronous exception), which
ends pure-Python work at its next bytecode -- a loop, a chain of calls -- so its later side effects do not happen; a
call blocked inside C code (one long ``time.sleep``, a socket read) stops when that returns. Either way the process
never waits for it: a daemon thread does not hold the interpreter's exit. The stop cannot run the tool's ``finally``
blocks' C-level cleanup early, and it is CPython-specific (elsewhere the call is only abandoned, as before).
"""

from __future__ import annotations

import ctypes
import inspect
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

from prefzoo.errors import ConfigError, describe_error

__all__ = ["tool_schema", "DEFAULT_RESPONSE_TEMPLATE", "default_tools_message", "template_supports_tools",
           "parse_turn", "call_tool", "ToolResult", "CALL_OPEN", "CALL_CLOSE"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

#: prefzoo's default call format as a transformers response template (``tokenizer.parse_response(text, schema=...)``):
#: the text outside the tags is the message's content, each ``<tool_call>...</tool_call>`` a JSON object
#: ``{"name", "arguments"}`` that becomes ``{"type": "function", "function": {...}}``.
DEFAULT_RESPONSE_TEMPLATE = {
    "version": 1,
    "start_anchor": "<|im_start|>assistant\n",
    "defaults": {"role": "assistant"},
    "fields": {
        "content": {"content": "text"},
        "tool_calls": {"open": CALL_OPEN, "close": CALL_CLOSE, "content": "json", "repeats": True,
                       "content_args": {"allow_non_json": True},
                       "transform": {"type": "function", "function": "{content}"}},
    },
}


def tool_schema(fn: Callable) -> dict:
    """The JSON schema of ``fn``, ``{"type": "function", "function": {"name", "description", "parameters"}}``
    (``transformers.utils.get_json_schema``).

    Raises:
        ConfigError: ``fn`` has an argument without a type hint or a docstring line (naming the tool and why).
    """
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
        return schema if "function" in schema else {"type": "function", "function": schema}
    except Exception as err:  # TypeHintParsingException, DocstringParsingException
        name = getattr(fn, "__qualname__", repr(fn))
        raise ConfigError(f"tool {name} has no usable schema: {err}. A tool needs a type hint and an 'Args:' line "
                          "in its docstring for every argument (TRL's rule).") from None


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a ``tools`` list (it mentions ``tools``)."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def default_tools_message(schemas: list[dict], instructions: str = "") -> dict:
    """The system message of the default format: what the tools are and how to call one."""
    lines = [instructions.strip()] if instructions.strip() else []
    lines += ["You can call these tools:"]
    lines += [json.dumps(s["function"], separators=(", ", ": ")) for s in schemas]
    lines += [f'To call a tool, write {CALL_OPEN}{{"name": <tool name>, "arguments": {{<argument>: <value>}}}}'
              f"{CALL_CLOSE} and stop; its result comes back in the next message. Without a tool call your "
              "message is your final answer."]
    return {"role": "system", "content": "\n".join(lines)}


_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def parse_turn(tokenizer, text: str, prefix: str) -> dict:
    """The policy's turn ``text`` as an assistant message ``{"role", "content", "tool_calls"?}``.

    With a tokenizer that carries a ``response_template``, that template parses it; otherwise
    :data:`DEFAULT_RESPONSE_TEMPLATE` does. A call whose body is not JSON stays in ``tool_calls`` as a string (it is
    answered with an error); ``prefix`` is the rendered conversation before the turn (``parse_response``'s).
    """
    schema = getattr(tokenizer, "response_template", None) or DEFAULT_RESPONSE_TEMPLATE
    try:
        message = tokenizer.parse_response(text, schema=schema, prefix=prefix)
    except Exception:  # a template that cannot read this turn: keep the text, take the calls the default way
        message = {"role": "assistant", "content": _CALL.sub("", text).strip()}
        calls = [_loads_or_text(body) for body in _CALL.findall(text)]
        if calls:
            message["tool_calls"] = [{"type": "function", "function": c} for c in calls]
    return message


def _loads_or_text(body: str):
    try:
        return json.loads(body)
    except ValueError:
        return body.strip()


@dataclass
class ToolResult:
    """One call's outcome: the tool message for the conversation, and whether it failed (and why)."""

    message: dict
    error: str | None = None


class ToolStopped(BaseException):
    """Raised inside a tool's thread once it has run past ``env.tool_timeout`` (:func:`run_with_timeout`); a
    ``BaseException``, so that a tool's own ``except Exception`` does not swallow it."""


def _stop(thread: threading.Thread) -> None:
    """Raise :class:`ToolStopped` in ``thread`` at its next Python bytecode (CPython; a no-op elsewhere)."""
    setter = getattr(getattr(ctypes, "pythonapi", None), "PyThreadState_SetAsyncExc", None)
    if setter is not None and thread.ident is not None:
        setter(ctypes.c_ulong(thread.ident), ctypes.py_object(ToolStopped))


def run_with_timeout(fn: Callable, arguments: dict, timeout: float) -> tuple[bool, Any, BaseException | None]:
    """``fn(**arguments)`` in a daemon thread: (finished in time, its result, what it raised -- anything, SystemExit
    included). A call still running at ``timeout`` seconds is stopped (:class:`ToolStopped`; see the module
    docstring) and answered (False, None, None) at once."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn(**arguments)
        except ToolStopped:
            pass
        except BaseException as err:  # noqa: BLE001 -- a tool's SystemExit is its failed call, never the run's end
            box["error"] = err

    thread = threading.Thread(target=target, daemon=True, name=f"prefzoo-tool-{getattr(fn, '__name__', 'call')}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        _stop(thread)
        return False, None, None
    return True, box.get("result"), box.get("error")


def call_tool(call: Any, tools: dict[str, Callable], timeout: float) -> ToolResult:
    """Run one parsed call (``{"type": "function", "function": {"name", "arguments"}}``) against ``tools`` (name ->
    callable), giving the ``{"role": "tool", "name", "content"}`` message; every failure is an error observation."""
    fn_part = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn_part, dict):
        return _error("unknown", f"malformed tool call {str(fn_part if fn_part is not None else call)[:80]!r}: write "
                                 f'{CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{CALL_CLOSE}')
    name, arguments = fn_part.get("name"), fn_part.get("arguments", {})
    if not isinstance(name, str) or name not in tools:
        return _error(str(name), f"unknown tool {name!r}; the tools are: {', '.join(sorted(tools))}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return _error(name, f"the arguments of {name} are not a JSON object: {arguments[:80]!r}")
    if not isinstance(arguments, dict):
        return _error(name, f"the arguments of {name} must be an object, got {type(arguments).__name__}")
    fn = tools[name]
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as err:
        return _error(name, f"bad arguments for {name}: {err}")
    finished, result, raised = run_with_timeout(fn, arguments, timeout)
    if not finished:
        return _error(name, f"{name} ran past env.tool_timeout={timeout} s and was stopped")
    if raised is not None:  # the tool raised: its message is the observation (TRL's behaviour)
        return _error(name, describe_error(raised))
    if isinstance(result, bool) or not isinstance(result, (str, int, float)):
        return _error(name, f"{name} returned a {type(result).__name__}, not text")
    return ToolResult({"role": "tool", "name": name, "content": str(result)})


def _error(name: str, why: str) -> ToolResult:
    return ToolResult({"role": "tool", "name": name, "content": json.dumps({"error": why})}, why)
