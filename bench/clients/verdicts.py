"""Whether a client run passed, as a user sees it: each check returns None when it did, else why not. The tests
assert on these and the bench prints them, so both judge a run the same way."""

from __future__ import annotations

from bench.clients.catalog import ALL
from bench.clients.proxy import Exchange
from bench.clients.reading import COMPLETE, answer_text, asked_limit, ending, output_tokens, refusals, replayed_result
from bench.clients.runs import MARKER_TEXT, ClientRun
from bench.clients.server import OLD_CAP


def last_served(run: ClientRun) -> Exchange | None:
    """The last request of the client's own dialect that the server (not the proxy) answered."""
    dialect = ALL[run.client].dialect
    served = [e for e in run.exchanges if e.dialect == dialect and not e.by_proxy]
    return served[-1] if served else None


def answered(run: ClientRun) -> str | None:
    """The run exited 0, nothing it sent was refused, and it printed the text the server answered its last turn."""
    if run.returncode != 0:
        return f"exited {run.returncode}"
    if refusals(run.exchanges):
        return f"refused: {refusals(run.exchanges)[0]}"
    last = last_served(run)
    if last is None:
        return "sent the server nothing"
    text = " ".join(answer_text(last).split())
    if not text:
        return f"the server's answer has no text ({last.summary()})"
    if text not in " ".join(run.stdout.split()):
        return f"did not print the server's answer {text[:80]!r}"
    return None


def completed(run: ClientRun) -> str | None:
    """The last answer ended by itself (no limit cut it)."""
    last = last_served(run)
    end = ending(last) if last else None
    return None if last and end == COMPLETE[last.dialect] else f"the answer ended {end!r}"


def round_trip(run: ClientRun) -> str | None:
    """The proxy answered the first turn with the call; the client ran it and sent call and result (the file's
    text) to the server, which answered; the client printed that answer and exited 0."""
    if [e.by_proxy for e in run.exchanges].count(True) != 1:
        return "the proxy's tool call was never asked for (the tool was not offered)"
    problem = answered(run)
    if problem:
        return problem
    result = replayed_result(last_served(run))
    if result is None or MARKER_TEXT not in result:
        return f"the tool's result was not sent back (got {result!r})"
    return completed(run)


def long_answer(run: ClientRun) -> str | None:
    """The last answer is longer than the old cap, with no limit sent, and ended by itself."""
    last = last_served(run)
    if last is None:
        return "sent the server nothing"
    if asked_limit(last) is not None:
        return f"the client sent a limit ({asked_limit(last)})"
    tokens = output_tokens(last)
    if tokens is None:  # a stream without usage (aider): the demo model ends by itself only after OLD_CAP tokens
        return completed(run)
    return completed(run) or (None if tokens > OLD_CAP else f"{tokens} tokens, not over {OLD_CAP}")
