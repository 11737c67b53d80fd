"""What every admin console handler shares: rendering a page or the partial htmx asked
for, and reading forms. The console's state is the gateway's (`Gateway.console`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from litestar import Request
from litestar.datastructures import FormMultiDict
from litestar.response import Template

from helexa.gateway.admin_auth import AdminSession

PACKAGE_DIR = Path(__file__).resolve().parents[1]
TEMPLATES_DIR = PACKAGE_DIR / "templates"
STATIC_DIR = PACKAGE_DIR / "static"
PREFIX = "/admin"


def template_environment() -> Environment:
    """Jinja for the console: autoescaped everywhere, and a typo in a template is an error."""
    env = Environment(
        loader=FileSystemLoader(TEMPLATES_DIR),
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["mib"] = _mib
    env.filters["num"] = lambda n: "-" if n is None else f"{n:,}"
    env.filters["usd"] = _usd
    return env


def _mib(mb: int | None) -> str:
    if mb is None:
        return "?"
    return f"{mb / 1024:.1f} GiB" if mb >= 1024 else f"{mb} MiB"


def _usd(value: float | None) -> str:
    """Dollars with the digits that matter: per-request costs are fractions of a cent."""
    if value is None:
        return "-"
    if value == 0:
        return "$0"
    if value < 0.01:
        return f"${value:.6f}"
    return f"${value:,.4f}" if value < 100 else f"${value:,.2f}"


def session_of(request: Request) -> AdminSession:
    """The logged-in session (the gate put it there before any handler runs)."""
    return request.state.admin_session


def wants_partial(request: Request) -> bool:
    """htmx swaps a page's main content; history restores and plain browsers get pages."""
    headers = request.headers
    return (
        headers.get("hx-request") == "true" and headers.get("hx-history-restore-request") != "true"
    )


def render(
    request: Request,
    page: str,
    *,
    partial: str | None = None,
    status: int = 200,
    headers: dict[str, str] | None = None,
    **context: Any,
) -> Template:
    """`admin/<page>.html`, or `admin/_<partial or page>.html` alone for an htmx request."""
    session = request.state.admin_session if "admin_session" in request.state else None
    context |= {"csrf": session.csrf if session else "", "nav": page, "prefix": PREFIX}
    name = f"admin/_{partial or page}.html" if wants_partial(request) else f"admin/{page}.html"
    return Template(name, context=context, status_code=status, headers=headers)


async def form_of(request: Request) -> FormMultiDict:
    return await request.form()


def text(form: FormMultiDict, name: str) -> str:
    value = form.get(name)
    return value.strip() if isinstance(value, str) else ""


def texts(form: FormMultiDict, name: str) -> list[str]:
    return [v.strip() for v in form.getall(name, []) if isinstance(v, str) and v.strip()]
