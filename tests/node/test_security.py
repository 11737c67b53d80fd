"""Who a node believes a caller is (helexa/node/security.py), without HTTP: the gateway's
principal and budget headers count only when NodeGuard marked the request trusted."""

from __future__ import annotations

import pytest

from helexa.errors import HelexaError
from helexa.node.security import budget_of, principal_of
from helexa.protocol.wire import ACCOUNT_HEADER, BUDGET_HEADER, KEY_HEADER, VIA_HEADER, SpendBudget


def test_a_trusted_gateway_names_the_principal_as_account_and_key():
    headers = {ACCOUNT_HEADER: "acme", KEY_HEADER: "k1", VIA_HEADER: "gw"}
    assert principal_of(headers, True, "10.0.0.2") == "acme/k1"
    assert principal_of({KEY_HEADER: "k1"}, True, "10.0.0.2") == "-/k1"


def test_the_gateways_anonymous_traffic_is_left_to_the_gateway():
    assert principal_of({VIA_HEADER: "gw"}, True, "10.0.0.2") is None


def test_an_untrusted_caller_is_counted_by_address_whatever_it_claims():
    headers = {ACCOUNT_HEADER: "acme", KEY_HEADER: "k1", VIA_HEADER: "gw"}
    assert principal_of(headers, False, "10.0.0.2") == "client:10.0.0.2"
    assert principal_of({}, True, "10.0.0.2") == "client:10.0.0.2"
    assert principal_of({}, False, None) == "client:?"


def test_a_budget_counts_only_from_a_trusted_caller():
    value = SpendBudget(tokens=100, cost=0.5, in_price=1.0, out_price=2.0).header()
    assert budget_of({BUDGET_HEADER: value}, True) == SpendBudget(100, 0.5, 1.0, 2.0)
    assert budget_of({BUDGET_HEADER: value}, False) is None
    assert budget_of({}, True) is None


def test_a_malformed_budget_is_a_400_naming_the_header():
    with pytest.raises(HelexaError) as err:
        budget_of({BUDGET_HEADER: "tokens=lots"}, True)
    assert (err.value.status, err.value.param) == (400, BUDGET_HEADER)
    assert err.value.message.startswith(f"{BUDGET_HEADER}: ")
