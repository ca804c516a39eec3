"""A strict extractor of the metric selectors and grouping labels of a PromQL expression (tests only).

Not a PromQL parser: it tokenizes the whole expression (any character it does not know is an
error) and walks the tokens, knowing the functions and aggregations by name, so that every
metric selector (``name{label op "value", ...}[range] offset d``) and every ``by``/``without``
label list is found with the selectors it applies to. Grafana variables are allowed where a
dashboard puts them: in label values (``"$tenant"``) and ranges (``[$__rate_interval]``).
Whatever it cannot read raises :class:`PromQLError`, so a query it does not understand fails
the test that checks it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

AGGREGATIONS = frozenset(
    {
        "sum",
        "avg",
        "min",
        "max",
        "count",
        "group",
        "stddev",
        "stdvar",
        "topk",
        "bottomk",
        "quantile",
        "count_values",
    }
)
FUNCTIONS = frozenset(
    {
        "rate",
        "irate",
        "increase",
        "delta",
        "idelta",
        "deriv",
        "changes",
        "resets",
        "abs",
        "absent",
        "absent_over_time",
        "avg_over_time",
        "min_over_time",
        "max_over_time",
        "sum_over_time",
        "count_over_time",
        "last_over_time",
        "quantile_over_time",
        "histogram_quantile",
        "clamp",
        "clamp_min",
        "clamp_max",
        "scalar",
        "vector",
        "time",
        "timestamp",
        "round",
        "ceil",
        "floor",
        "sort",
        "sort_desc",
        "label_replace",
        "label_join",
        "predict_linear",
        "sgn",
        "exp",
        "ln",
    }
)
KEYWORDS = frozenset({"and", "or", "unless", "bool"})
MATCHING = frozenset({"on", "ignoring", "group_left", "group_right"})
GROUPING = frozenset({"by", "without"})

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<range>\[\s*(?:\d+[smhdwy]|\$\w+|\$\{\w+\})(?::(?:\d+[smhdwy])?)?\s*\])
  | (?P<duration>\d+(?:ms|[smhdwy]))(?![\w.])
  | (?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<matchop>=~|!~|!=|==|>=|<=)
  | (?P<op>[-+*/%^<>=])
  | (?P<punct>[(){},])
""",
    re.VERBOSE,
)


class PromQLError(ValueError):
    """The expression is not one this extractor reads."""


@dataclass
class Selector:
    name: str
    matchers: list[tuple[str, str, str]] = field(default_factory=list)  # (label, op, value)


@dataclass
class Grouping:
    """``by``/``without`` (or ``on``/``ignoring``/``group_*``) labels and the selectors they
    apply to (an aggregation's argument; for vector matching, both sides: the whole query)."""

    keyword: str
    labels: list[str]
    selectors: list[Selector]


@dataclass
class Query:
    selectors: list[Selector]
    groupings: list[Grouping]


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise PromQLError(f"cannot read {expr[pos : pos + 20]!r} at {pos} of {expr!r}")
        pos = m.end()
        kind = m.lastgroup or ""
        if kind != "ws":
            out.append((kind, m.group()))
    return out


class _Walker:
    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.toks = _tokens(expr)
        self.i = 0
        self.selectors: list[Selector] = []
        self.groupings: list[Grouping] = []

    def fail(self, what: str) -> PromQLError:
        return PromQLError(f"{what} at token {self.i} of {self.expr!r}")

    def peek(self, k: int = 0) -> tuple[str, str]:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else ("end", "")

    def take(self, kind: str, text: str | None = None) -> str:
        k, t = self.peek()
        if k != kind or (text is not None and t != text):
            raise self.fail(f"expected {text or kind}, found {t or 'the end'!r}")
        self.i += 1
        return t

    def labels(self) -> list[str]:
        self.take("punct", "(")
        out: list[str] = []
        while self.peek() != ("punct", ")"):
            out.append(self.take("ident"))
            if self.peek() == ("punct", ","):
                self.i += 1
        self.take("punct", ")")
        return out

    def group(self) -> None:
        """A parenthesised sequence from ``(`` to its ``)``."""
        self.take("punct", "(")
        while self.peek() != ("punct", ")"):
            if self.peek()[0] == "end":
                raise self.fail("unclosed (")
            self.item()
        self.take("punct", ")")

    def selector(self, name: str) -> None:
        sel = Selector(name)
        if self.peek() == ("punct", "{"):
            self.i += 1
            while self.peek() != ("punct", "}"):
                label = self.take("ident")
                k, op = self.peek()
                if op not in ("=", "!=", "=~", "!~"):
                    raise self.fail(f"bad matcher operator {op!r}")
                self.i += 1
                sel.matchers.append((label, op, self.take("string")[1:-1]))
                if self.peek() == ("punct", ","):
                    self.i += 1
            self.take("punct", "}")
        if self.peek()[0] == "range":
            self.i += 1
        if self.peek() == ("ident", "offset"):
            self.i += 1
            self.take("duration")
        self.selectors.append(sel)

    def aggregation(self) -> None:
        labels: list[str] = []
        keyword = ""
        if self.peek()[1] in GROUPING:
            keyword = self.take("ident")
            labels = self.labels()
        start = len(self.selectors)
        self.group()
        if not keyword and self.peek()[1] in GROUPING:
            keyword = self.take("ident")
            labels = self.labels()
        if keyword:
            self.groupings.append(Grouping(keyword, labels, self.selectors[start:]))

    def item(self) -> None:
        kind, text = self.peek()
        if kind == "ident":
            self.i += 1
            if text in AGGREGATIONS and self.peek()[1] in ("(", *GROUPING):
                self.aggregation()
            elif text in FUNCTIONS and self.peek() == ("punct", "("):
                self.group()
            elif text in MATCHING:
                labels = self.labels() if self.peek() == ("punct", "(") else []
                self.groupings.append(Grouping(text, labels, []))  # filled with every selector
            elif text in KEYWORDS:
                pass
            elif self.peek() == ("punct", "("):
                raise self.fail(f"unknown function {text!r}")
            else:
                self.selector(text)
        elif kind in ("number", "string", "op", "matchop") or (kind, text) == ("punct", ","):
            self.i += 1
        elif (kind, text) == ("punct", "("):
            self.group()
        else:
            raise self.fail(f"unexpected {text!r}")


def parse(expr: str) -> Query:
    """The selectors and groupings of ``expr`` (PromQLError when it cannot read it)."""
    w = _Walker(expr)
    if not w.toks:
        raise PromQLError("empty expression")
    while w.peek()[0] != "end":
        w.item()
    for g in w.groupings:
        if g.keyword in MATCHING:
            g.selectors = list(w.selectors)
    if not w.selectors:
        raise PromQLError(f"no metric selector in {expr!r}")
    return Query(w.selectors, w.groupings)


_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>[a-zA-Z_]\w*)\)$")


def parse_variable(query: str) -> tuple[Query, str]:
    """A Grafana ``label_values(selector, label)`` variable query: its selector and label."""
    m = _LABEL_VALUES.match(query.strip())
    if m is None:
        raise PromQLError(f"not a label_values(selector, label) query: {query!r}")
    return parse(m["selector"]), m["label"]
