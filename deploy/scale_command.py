"""`splitserve scale`: resize a running cluster's pools through its gateway's admin API (router/admin.py).

    splitserve scale --url http://GATEWAY --prefill N --decode M     (either pool alone, or --colocated K)

The token comes from --admin-token or SPLITSERVE_ADMIN_TOKEN. Returns when the gateway answered, that is when the
new workers serve or the removed ones are gone; prints the pools then. Standard library only (urllib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

TOKEN_ENV = "SPLITSERVE_ADMIN_TOKEN"  # router/admin.py's ADMIN_TOKEN_ENV (not imported: it pulls in FastAPI)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("scale", help="resize the prefill / decode pools of a running cluster",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:8000")
    p.add_argument("--prefill", type=int, default=None, help="prefill workers wanted")
    p.add_argument("--decode", type=int, default=None, help="decode workers wanted")
    p.add_argument("--colocated", type=int, default=None, help="colocated workers wanted (a --colocated cluster)")
    p.add_argument("--admin-token", default=None, help=f"the gateway's admin token (default: ${TOKEN_ENV})")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the gateway's answer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    body = {role: n for role in ("prefill", "decode", "colocated") if (n := getattr(args, role)) is not None}
    if not body:
        raise ValueError("name at least one pool: --prefill, --decode or --colocated")
    token = args.admin_token or os.environ.get(TOKEN_ENV)
    if not token:
        raise ValueError(f"an admin token is needed: --admin-token or ${TOKEN_ENV}")
    request = urllib.request.Request(
        f"{args.url.rstrip('/')}/admin/scale", data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            workers = json.load(response)["workers"]
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        print(f"splitserve: error: the gateway answered {error.code}: {detail}", file=sys.stderr)
        return 1
    except urllib.error.URLError as error:
        print(f"splitserve: error: cannot reach {args.url}: {error.reason}", file=sys.stderr)
        return 1
    for worker in workers:
        print(f"{worker['worker_id']:<14} {worker['role']:<10} {worker['state']:<9} {worker['endpoint']}")
    return 0
