"""What the admin console changes, without HTTP: catalogue and alias edits in a real
SQLite database, a key's allowed models, and budgets that follow a changed window."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from helexa.gateway import catalogue_edit as edit
from helexa.gateway.budgets import Budgets
from helexa.gateway.keys import KeyStore
from helexa.gateway.ledger import Ledger, book_row

NODES = ["a", "b"]


def entry(**form):
    pinned = form.pop("pinned_on", [])
    return edit.entry_from_form({"id": "org/m"} | form, pinned, NODES)


def test_a_model_is_added_edited_pinned_and_deleted(sessions):
    edit.add_model(sessions, entry(quant="Q4_K_M", cost_input="0.5", pinned_on=["a"]))
    [m], _ = edit.catalogue_rows(sessions)
    assert (m.id, m.quant, m.cost.input, m.pinned_on) == ("org/m", "Q4_K_M", 0.5, ["a"])
    edit.update_model(sessions, entry(dtype="bfloat16", tensor_parallel="2"))
    [m], _ = edit.catalogue_rows(sessions)
    assert (m.quant, m.dtype, m.tensor_parallel, m.pinned_on) == (None, "bfloat16", 2, [])
    edit.set_pinned(sessions, "org/m", "b", True)
    assert edit.catalogue_rows(sessions)[0][0].pinned_on == ["b"]
    edit.set_pinned(sessions, "org/m", "b", False)
    assert edit.catalogue_rows(sessions)[0][0].pinned_on == []
    edit.delete_model(sessions, "org/m")
    assert edit.catalogue_rows(sessions) == ([], {})


def test_a_models_speculative_decoding_is_saved_and_cleared(sessions):
    spec = {"speculative_method": "ngram", "num_speculative_tokens": "3"}
    edit.add_model(sessions, entry(quant="int8", **spec))
    [m], _ = edit.catalogue_rows(sessions)
    assert (m.quant, m.speculative_method, m.num_speculative_tokens) == ("int8", "ngram", 3)
    draft = {"speculative_method": "draft_model", "speculative_model": " org/draft "}
    edit.update_model(sessions, entry(**draft))
    [m], _ = edit.catalogue_rows(sessions)
    assert (m.speculative_method, m.speculative_model) == ("draft_model", "org/draft")
    assert m.num_speculative_tokens is None
    edit.update_model(sessions, entry(speculative_method=""))  # blank: the node's setting
    [m], _ = edit.catalogue_rows(sessions)
    assert (m.speculative_method, m.speculative_model, m.num_speculative_tokens) == (None,) * 3


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({"id": " "}, "id: a model id is required"),
        ({"speculative_method": "eagle"}, "speculative_method: expected one of ngram, draft_model"),
        ({"num_speculative_tokens": "0"}, "num_speculative_tokens: must be at least 1"),
        ({"num_speculative_tokens": "17"}, "num_speculative_tokens: at most 16, got 17"),
        ({"num_speculative_tokens": "x"}, "num_speculative_tokens: expected a whole number"),
        ({"speculative_method": "draft_model"}, "speculative_model: required with"),
        ({"speculative_model": "o/d"}, "speculative_model: only with speculative_method"),
        ({"speculative_method": "off", "speculative_model": "o/d"}, r"\(it is 'off'\)"),
        ({"dtype": "fp8"}, "dtype: expected one of auto, float32"),
        ({"tensor_parallel": "two"}, "tensor_parallel: expected a whole number"),
        ({"tensor_parallel": "0"}, "tensor_parallel: must be at least 1"),
        ({"tensor_parallel": "2", "min_devices": "1"}, "min_devices: 1 is below tensor_parallel 2"),
        ({"cost_output": "-1"}, "cost_output: must be a price of 0 or more"),
        ({"cost_input": "nan"}, "cost_input: must be a price"),
        ({"pinned_on": ["c"]}, "pinned_on: c is not a configured node"),
    ],
)
def test_a_bad_catalogue_form_names_its_field(form, message):
    with pytest.raises(ValueError, match=message):
        entry(**form)


def test_duplicates_unknown_ids_and_aliases_in_use_are_refused(sessions):
    edit.add_model(sessions, entry())
    with pytest.raises(ValueError, match="already in the catalogue"):
        edit.add_model(sessions, entry())
    with pytest.raises(ValueError, match="not in the catalogue"):
        edit.update_model(sessions, entry(id="org/other"))
    edit.set_alias(sessions, "small", "org/m")
    with pytest.raises(ValueError, match="target of alias 'small'"):
        edit.delete_model(sessions, "org/m")
    with pytest.raises(ValueError, match="target: 'nope' is not in the catalogue"):
        edit.set_alias(sessions, "x", "nope")
    with pytest.raises(ValueError, match="is a catalogue id"):
        edit.set_alias(sessions, "org/m", "org/m")
    with pytest.raises(ValueError, match="already an alias"):
        edit.add_model(sessions, entry(id="small"))


def test_an_alias_is_repointed_and_deleted(sessions):
    edit.add_model(sessions, entry())
    edit.add_model(sessions, entry(id="org/n"))
    edit.set_alias(sessions, "small", "org/m")
    edit.set_alias(sessions, "small", "org/n")
    assert edit.catalogue_rows(sessions)[1] == {"small": "org/n"}
    edit.delete_alias(sessions, "small")
    assert edit.catalogue_rows(sessions)[1] == {}
    with pytest.raises(ValueError, match="does not exist"):
        edit.delete_alias(sessions, "small")


def test_a_keys_allowed_models_can_be_changed_and_cleared(sessions):
    store = KeyStore(sessions)
    key, _ = store.create("acme", models=["m1"])
    assert store.set_models(key.id, ["m2", "m3"]).allowed_models == ("m2", "m3")
    assert store.set_models(key.id, None).allowed_models is None
    with pytest.raises(KeyError):
        store.set_models("key_nope", None)


def test_budgets_recount_a_key_whose_window_changed(sessions):
    """Switching a key from a balance to a rolling hour must stop counting old spend."""
    store = KeyStore(sessions)
    key, _ = store.create("acme", cap_tokens=100)
    old = {
        "ts": datetime.now(UTC) - timedelta(hours=3),
        "key_id": key.id,
        "account_id": "acme",
        "model": "m",
        "status": 200,
        "prompt_tokens": 90,
    }
    with sessions.kw["bind"].begin() as conn:
        book_row(conn, old)  # the ledger row and the key's lifetime total, as the gateway books

    async def main():
        books = Ledger.over(sessions.kw["bind"])
        books.start()
        budgets = Budgets(books)
        try:
            first = await budgets.reserve(key, "m", 5, 200, (0.0, 0.0))
            rolling = store.set_budget(key.id, cap_tokens=100, window="rolling:3600")
            second = await budgets.reserve(rolling, "m", 5, 200, (0.0, 0.0))
            return first, second
        finally:
            await books.close()

    first, second = asyncio.run(main())
    assert first.max_output == 5  # 90 of 100 spent, 5 for the prompt
    # the 90 old tokens left the window; the first request's reservation still counts
    assert second.max_output == 100 - first.tokens - 5
