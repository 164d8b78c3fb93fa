"""Text helpers that several rooms share, at the bottom of the house (like :mod:`prefzoo.errors`, it imports nothing of
prefzoo, and every room may import it):

* :data:`NUMBER_PATTERN` and :func:`extract_final_number`: how a number is read from text -- the data checks a task's
  answers with it (:mod:`prefzoo.data.reasoning_gym`), the rewards read a completion's answer with it
  (:mod:`prefzoo.rewards.arithmetic`, :mod:`prefzoo.rewards.reasoning_gym`), the built-in environments read the
  policy's answer with it (:mod:`prefzoo.environments.builtin`).
* :func:`server_address`: a server's ``http(s)://host:port`` checked (the config's ``rollout.servers``, the server
  engine).
* :func:`words` and :func:`distinct_n`: distinct-n over word and punctuation tokens (Li et al. 2016) -- the
  evaluation measures diversity with it (:mod:`prefzoo.evaluation.diversity`), the fluent-sentiment reward scores
  with it (:mod:`prefzoo.rewards.sentiment`).
"""

from __future__ import annotations

import re

__all__ = ["NUMBER_PATTERN", "WORD", "words", "distinct_n", "extract_final_number", "server_address"]

# A number: an optional sign, digits (optionally grouped by thousands commas), an optional decimal part.
# A minus (ASCII "-" or Unicode "−") is a sign only when a digit follows it directly and no word
# character or ")" precedes it, so "10-3" reads as 10 and 3, while "x = -3" reads as -3.
# Thousands groups must be complete ("1,234", not "1,2345"); a list such as "1,2,3" reads as 1, 2, 3.
# A decimal point needs a digit after it, so the period ending "is 78." is not part of the number.
NUMBER_PATTERN = re.compile(
    r"(?:(?<![\w)])[-\u2212])?"
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
    r"(?:\.\d+)?"
)

WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """Lower-cased word and punctuation tokens (so '!!!' counts as three '!' tokens)."""
    return WORD.findall(text.lower())


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct-n of a set of texts: unique n-grams / total n-grams over all of them (Li et al. 2016, sec. 4).

    Returns 0.0 when the texts hold no n-gram. Units: a fraction in [0, 1].
    """
    grams = []
    for t in texts:
        w = words(t)
        grams += [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def _to_number(token: str) -> int | float:
    token = token.replace(",", "").replace("\u2212", "-")
    return float(token) if "." in token else int(token)


def extract_final_number(text: str) -> int | float | None:
    """The last number written in ``text``, or None when it has none.

    Reads "1,234" as 1234, "-5" (and "−5") as -5, "= 78." as 78, "2.5" as 2.5 (a float; an int when
    there is no decimal point). See :data:`prefzoo.text.NUMBER_PATTERN` for the exact rule.

    Examples:
        >>> extract_final_number("23 + 45 = 68.")
        68
        >>> extract_final_number("I owe -1,200 dollars")
        -1200
        >>> extract_final_number("no digits here") is None
        True
    """
    last = None
    for last in NUMBER_PATTERN.finditer(text):
        pass
    return None if last is None else _to_number(last.group())


SERVER_FIX = "give http://host:port (e.g. http://127.0.0.1:8000, the address `prefzoo serve --port 8000` prints)"


def server_address(url) -> tuple[str | None, str | None]:
    """``(address, None)``: ``url`` as ``http(s)://host[:port]`` without a trailing slash; or ``(None, problem)``: why it
    is not a server's address (another scheme, no host, a port that is not a number in 0..65535, a user, a path, a query
    or a fragment): the rest of a message that begins with the value (it starts with its own space or colon)."""
    from urllib.parse import urlparse

    parsed = urlparse(str(url))
    try:
        port = parsed.port
    except ValueError:  # a port that is not a number in 0..65535
        port = -1
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port == -1 or parsed.username:
        return None, f" is not a server address; {SERVER_FIX}."
    if parsed.path.rstrip("/") or parsed.query or parsed.fragment:
        return None, (f": give the server's address without a path (not .../v1: prefzoo adds the routes); "
                      f"{SERVER_FIX}.")
    return str(url).rstrip("/"), None
