"""Where the front converts custom tools' Lark grammars (appliance.front.api.lark_grammar): in a helper process
(`python -m appliance.front.api.grammar_helper`, appliance.front.helper_process's protocol) with a time bound and
an address-space limit, never in the front's threads. A conversion is bounded by construction (the lark_grammar
limits); the process is the second line: one that still runs past CONVERT_TIMEOUT_S is killed and replaced, and
its request refused, and lark's memory is never the front's.

The front keeps a small cache, keyed by the definition's digest: refusals (a hostile client resending one bomb
costs a dictionary look-up) and results of at most CACHED_RESULT_CHARS (Codex sends the same grammar every turn).
A larger result reaches its own request only (REQUEST_CONVERSIONS, a context variable of the request's task) and
is not kept.
"""

from __future__ import annotations

import collections
import contextvars
import hashlib
import os
import resource
import sys
from typing import Any

from appliance.front.api import lark_grammar
from appliance.front.helper_process import HelperFailed, HelperFault, HelperProcess
from appliance.ipc import serve_requests

MODULE = "appliance.front.api.grammar_helper"
# The limits keep a conversion to milliseconds; past this it is killed. Generous: it also covers a fresh
# process's start (Python and lark's import, seconds on a loaded host) after the last one was replaced.
CONVERT_TIMEOUT_S = 30.0
ADDRESS_SPACE_BYTES = 2 << 30  # the helper's own limit: lark's trees of a bomb can never take the host's memory
CACHE_ENTRIES = 256
CACHED_RESULT_CHARS = 16 << 10
MAX_REFUSAL_CHARS = 1000

Conversion = lark_grammar.Converted
REQUEST_CONVERSIONS: contextvars.ContextVar[dict[str, Conversion] | None] = \
    contextvars.ContextVar("request_conversions", default=None)


def digest(definition: str) -> bytes:
    return hashlib.sha256(definition.encode("utf-8", "surrogatepass")).digest()


class GrammarConverter:
    """The front's handle: convert() before a body is parsed, conversion() while it is."""

    def __init__(self, timeout_s: float = CONVERT_TIMEOUT_S):
        # a reply is JSON of at most MAX_EBNF_CHARS characters, each at most 6 bytes escaped
        self.process = HelperProcess(MODULE, timeout_s, "grammar converter",
                                      reply_bytes=6 * lark_grammar.MAX_EBNF_CHARS + 4096)
        self.cache: collections.OrderedDict[bytes, Conversion] = collections.OrderedDict()

    async def convert(self, definitions: list[str]) -> None:
        """Convert a request's grammars (each in the helper unless the cache or a cheap check answers), for
        conversion() to find while its body is parsed in this task."""
        found: dict[str, Conversion] = {}
        for definition in definitions:
            found[definition] = await self._one(definition)
        REQUEST_CONVERSIONS.set(found)

    async def _one(self, definition: str) -> Conversion:
        key = digest(definition)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        try:
            lark_grammar.check_definition(definition)  # length and nesting: no process needed to refuse
            result = Conversion(**await self.process.answer({"definition": definition}, b""))
        except lark_grammar.GrammarNotConvertible as exc:
            result = lark_grammar.refused(exc)
        except HelperFault:  # not remembered: a loaded host may convert it next time
            return Conversion("", f"the Lark grammar took more than {self.process.timeout_s:g} s to convert: the "
                              "conversion was stopped", lark_grammar.TOO_LARGE)
        except HelperFailed:
            result = Conversion("", "converting the Lark grammar ran out of memory", lark_grammar.TOO_LARGE)
        if result.refusal is not None:
            result = result._replace(refusal=result.refusal[:MAX_REFUSAL_CHARS])
        if result.refusal is not None or len(result.ebnf) <= CACHED_RESULT_CHARS:
            self.cache[key] = result
            if len(self.cache) > CACHE_ENTRIES:
                self.cache.popitem(last=False)
        return result

    async def close(self) -> None:
        await self.process.close()


CONVERTER = GrammarConverter()


def conversion(definition: str) -> Conversion | None:
    """The conversion convert() made for this request, else a remembered one; None if neither has it."""
    found = (REQUEST_CONVERSIONS.get() or {}).get(definition)
    return found if found is not None else CONVERTER.cache.get(digest(definition))


def _handle(request: dict[str, Any], data: bytes) -> dict[str, Any]:
    return lark_grammar.converted(request["definition"])._asdict()


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))
    os.nice(5)  # conversions yield to the model workers on a busy box
    lark_grammar.converted('start: "a"')  # lark imported and its grammar of grammars built before the first request
    serve_requests(sys.stdin.buffer, sys.stdout.buffer, _handle)


if __name__ == "__main__":
    main()
