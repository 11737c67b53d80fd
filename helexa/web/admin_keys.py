"""The Keys page: create (the secret shown once), revoke, caps and window, allowed models,
and each key's spend against its cap.

Every gateway on the database sees a change within auth's cache time (2 s) or its poll
interval, whichever is shorter: keys and budgets are read from the database, and a changed
window is recounted from the ledger (budgets.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Request, Response, get, post
from litestar.datastructures import FormMultiDict

from helexa.gateway.keys import check_budget
from helexa.gateway.service import Gateway
from helexa.gateway.spend_query import keys_and_usage
from helexa.web.admin_common import form_of, render, text, texts


def parse_budget(form: FormMultiDict) -> dict[str, Any]:
    """cap_tokens, cap_cost_usd and window from the budget fields (blank caps: no cap),
    checked by the key store's own budget rule."""
    tokens, cost = text(form, "cap_tokens"), text(form, "cap_cost")
    out: dict[str, Any] = {"cap_tokens": None, "cap_cost_usd": None, "window": "balance"}
    if tokens:
        try:
            out["cap_tokens"] = int(tokens.replace(",", "").replace("_", ""))
        except ValueError:
            raise ValueError(f"token cap: expected a whole number, got {tokens!r}") from None
    if cost:
        try:
            out["cap_cost_usd"] = float(cost.removeprefix("$"))
        except ValueError:
            raise ValueError(f"cost cap: expected an amount in USD, got {cost!r}") from None
    if text(form, "window") == "rolling":
        seconds = text(form, "window_seconds")
        if not seconds.isdigit():
            raise ValueError(
                f"window: a rolling window needs its length in seconds (e.g. 3600), got {seconds!r}"
            )
        out["window"] = f"rolling:{int(seconds)}"
    elif text(form, "window") not in ("", "balance"):
        raise ValueError(f"window: expected balance or rolling, got {text(form, 'window')!r}")
    check_budget(**out, names=("token cap", "cost cap"))
    return out


def _models(form: FormMultiDict) -> list[str] | None:
    chosen = texts(form, "models")
    return chosen or None  # nothing ticked: every model


async def _page(request: Request, gateway: Gateway, status: int = 200, **extra: Any) -> Response:
    keys, usage = await asyncio.to_thread(keys_and_usage, gateway.keys)
    keys.sort(key=lambda k: (not k.is_active, k.account_id, k.created_at))
    context = {
        "keys": keys,
        "usage": usage,
        "model_choices": sorted(gateway.router.catalogue) + sorted(gateway.router.aliases),
        "created": None,
        "secret": None,
        "notice": None,
        "error": None,
        "error_key": None,  # the key whose edit form failed; None: the create form
        "form": {},
    }
    return render(request, "keys", status=status, **(context | extra))


@get("/keys")
async def keys_page(request: Request, gateway: Gateway) -> Response:
    return await _page(request, gateway)


@post("/keys")
async def create_key(request: Request, gateway: Gateway) -> Response:
    form = await form_of(request)
    try:
        if not text(form, "account"):
            raise ValueError("account: every key belongs to an account; name one")
        budget = parse_budget(form)
        info, secret = await asyncio.to_thread(
            gateway.keys.create,
            text(form, "account"),
            name=text(form, "name") or None,
            models=_models(form),
            **budget,
        )
    except ValueError as e:
        return await _page(request, gateway, 422, error=str(e), form=dict(form))
    return await _page(request, gateway, created=info, secret=secret)


@post("/keys/edit")
async def edit_key(request: Request, gateway: Gateway) -> Response:
    form = await form_of(request)
    key_id = text(form, "id")

    def save() -> None:
        gateway.keys.set_budget(key_id, **parse_budget(form))
        gateway.keys.set_models(key_id, _models(form))

    try:
        await asyncio.to_thread(save)
    except KeyError:
        return await _page(request, gateway, 422, error=f"unknown key {key_id!r}")
    except ValueError as e:
        return await _page(request, gateway, 422, error=str(e), error_key=key_id)
    return await _page(request, gateway, notice=f"Saved {key_id}.")


@post("/keys/revoke")
async def revoke_key(request: Request, gateway: Gateway) -> Response:
    key_id = text(await form_of(request), "id")
    store = gateway.keys
    if not await asyncio.to_thread(store.revoke, key_id):
        known = await asyncio.to_thread(store.get, key_id)
        why = "is already revoked" if known else "does not exist"
        return await _page(request, gateway, 422, error=f"key {key_id!r} {why}")
    return await _page(
        request, gateway, notice=f"Revoked {key_id}; it stops working within 2 seconds."
    )


KEY_HANDLERS = [keys_page, create_key, edit_key, revoke_key]
