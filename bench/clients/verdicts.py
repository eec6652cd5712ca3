"""Whether a client run passed, as a user sees it: each check returns None when it did, else why not. The tests
assert on these and the bench prints them, so both judge a run the same way."""

from __future__ import annotations

from bench.clients.catalog import ALL
from bench.clients.proxy import Exchange
from bench.clients.reading import COMPLETE, answer_text, asked_limit, ending, output_tokens, refusals, replayed_result
from bench.clients.runs import MARKER_TEXT, ClientRun
from bench.clients.server import OLD_CAP


def served(run: ClientRun) -> list[Exchange]:
    """The requests of the client's own dialect that the server (not the proxy) answered."""
    dialect = ALL[run.client].dialect
    return [e for e in run.exchanges if e.dialect == dialect and not e.by_proxy]


def printed(run: ClientRun, exchange: Exchange) -> bool:
    text = " ".join(answer_text(exchange).split())
    return bool(text) and text in " ".join(run.stdout.split())


def shown(run: ClientRun) -> Exchange | None:
    """The last answer the client printed: the one its user saw (a client may send side requests after it, as
    Qwen Code does)."""
    return next((e for e in reversed(served(run)) if printed(run, e)), None)


def answered(run: ClientRun) -> str | None:
    """The run exited 0, nothing it sent was refused, and it printed an answer the server sent."""
    if run.returncode != 0:
        return f"exited {run.returncode}"
    if refusals(run.exchanges):
        return f"refused: {refusals(run.exchanges)[0]}"
    if not served(run):
        return "sent the server nothing"
    if shown(run) is None:
        return f"printed none of the server's answers (the last: {answer_text(served(run)[-1])[:80]!r})"
    return None


def completed(run: ClientRun, exchange: Exchange | None = None) -> str | None:
    """The answer (default: the one shown) ended by itself, no limit cut it."""
    exchange = exchange or shown(run)
    end = ending(exchange) if exchange else None
    return None if exchange and end == COMPLETE[exchange.dialect] else f"the answer ended {end!r}"


def round_trip(run: ClientRun) -> str | None:
    """The proxy answered the first turn with the call; the client ran it and sent call and result (the file's
    text) to the server, which answered; the client printed that answer and exited 0."""
    if [e.by_proxy for e in run.exchanges].count(True) != 1:
        return "the proxy's tool call was never asked for (the tool was not offered)"
    problem = answered(run)
    if problem:
        return problem
    results = [(e, replayed_result(e)) for e in served(run) if replayed_result(e) is not None]
    if not results or MARKER_TEXT not in results[0][1]:
        return f"the tool's result was not sent back (got {results[0][1] if results else None!r})"
    second_turn = results[0][0]
    if not printed(run, second_turn):
        return f"did not print the answer to the tool's result ({answer_text(second_turn)[:80]!r})"
    return completed(run, second_turn)


def long_answer(run: ClientRun) -> str | None:
    """The last answer is longer than the old cap, with no limit sent, and ended by itself."""
    last = shown(run)
    if last is None:
        return answered(run)
    if asked_limit(last) is not None:
        return f"the client sent a limit ({asked_limit(last)})"
    tokens = output_tokens(last)
    if tokens is None:  # a stream without usage (aider): the demo model ends by itself only after OLD_CAP tokens
        return completed(run)
    return completed(run) or (None if tokens > OLD_CAP else f"{tokens} tokens, not over {OLD_CAP}")
