"""The PromQL selector extractor that checks the dashboard and alert queries is strict: what it
cannot read fails, and what it reads it reports whole (selectors, matchers, grouping labels)."""

from __future__ import annotations

import pytest
from promql_selectors import PromQLError, parse, parse_variable


def test_selectors_matchers_and_grouping_labels_are_found() -> None:
    q = parse(
        "histogram_quantile(0.99, sum by (le, method) (rate(kvtier_rpc_duration_seconds_bucket"
        '{instance=~"$instance"}[$__rate_interval])))'
    )
    assert [s.name for s in q.selectors] == ["kvtier_rpc_duration_seconds_bucket"]
    assert q.selectors[0].matchers == [("instance", "=~", "$instance")]
    assert [(g.keyword, g.labels, [s.name for s in g.selectors]) for g in q.groupings] == [
        ("by", ["le", "method"], ["kvtier_rpc_duration_seconds_bucket"])
    ]


def test_a_grouping_applies_to_its_own_argument_only() -> None:
    q = parse(
        'sum by (tier) (rate(a_total[5m])) / scalar(sum(rate(b_total{x="1"}[5m] offset 1d)))'
        " and sum(c) without (y) > 0.5"
    )
    assert [s.name for s in q.selectors] == ["a_total", "b_total", "c"]
    assert [(g.keyword, g.labels, [s.name for s in g.selectors]) for g in q.groupings] == [
        ("by", ["tier"], ["a_total"]),
        ("without", ["y"], ["c"]),
    ]


def test_vector_matching_labels_apply_to_every_selector() -> None:
    q = parse("a / on (tenant) group_left b")
    assert [(g.keyword, g.labels, len(g.selectors)) for g in q.groupings] == [
        ("on", ["tenant"], 2),
        ("group_left", [], 2),
    ]


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "sum(",
        "rate(x[5m]",
        'x{a~"b"}',
        "x{a=b}",
        "frobnicate(x)",
        "x[5 m]",
        "x @ 5",
        '{__name__="x"}',
        "x # comment",
        "42",
    ],
)
def test_what_it_cannot_read_is_an_error(bad: str) -> None:
    with pytest.raises(PromQLError):
        parse(bad)


def test_label_values_variables() -> None:
    q, label = parse_variable('label_values(kvtier_lookups_total{instance=~"$instance"}, tenant)')
    assert label == "tenant" and q.selectors[0].name == "kvtier_lookups_total"
    with pytest.raises(PromQLError):
        parse_variable("query_result(up)")
