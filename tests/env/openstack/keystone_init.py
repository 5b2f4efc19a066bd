"""Fills a freshly bootstrapped Keystone through its own REST API, as an operator would: a
project and a user for Kuryr, an application credential of that user, and catalog entries for the
services started beside it. Prints KEY=VALUE lines (ids and secrets) for up.sh's env file.

    keystone_init.py AUTH_URL ADMIN_PASSWORD USER_PASSWORD [TYPE=NAME=URL ...]

Only the standard library: it runs with any Python.
"""

import json
import sys
import urllib.error
import urllib.request

PROJECT = "kuryr"
USER = "kuryr"
ROLE = "member"
APP_CRED = "kuryr-tests"
REGION = "RegionOne"


def call(base, method, path, token=None, body=None, want=(200, 201, 204)):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    req.add_header("Accept", "application/json")
    if token:
        req.add_header("X-Auth-Token", token)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text = resp.read().decode()
            return resp.status, resp.headers, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        raise SystemExit(f"keystone_init: {method} {path} answered {e.code}: {detail}") from None


def admin_token(base, password):
    body = {
        "auth": {
            "identity": {
                "methods": ["password"],
                "password": {"user": {"name": "admin", "domain": {"id": "default"}, "password": password}},
            },
            "scope": {"project": {"name": "admin", "domain": {"id": "default"}}},
        }
    }
    _, headers, _ = call(base, "POST", "/v3/auth/tokens", body=body)
    return headers["X-Subject-Token"]


def user_token(base, user_id, password, project_id):
    body = {
        "auth": {
            "identity": {"methods": ["password"], "password": {"user": {"id": user_id, "password": password}}},
            "scope": {"project": {"id": project_id}},
        }
    }
    _, headers, _ = call(base, "POST", "/v3/auth/tokens", body=body)
    return headers["X-Subject-Token"]


def find_one(base, token, collection, name):
    _, _, body = call(base, "GET", f"/v3/{collection}?name={name}", token)
    items = body[collection]
    if len(items) != 1:
        raise SystemExit(f"keystone_init: expected one {collection} named {name!r}, found {len(items)}")
    return items[0]["id"]


def main():
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    auth_url, admin_password, user_password = sys.argv[1:4]
    base = auth_url.rstrip("/").removesuffix("/v3")
    services = [arg.split("=", 2) for arg in sys.argv[4:]]
    for s in services:
        if len(s) != 3:
            raise SystemExit(f"keystone_init: catalog entries are TYPE=NAME=URL, got {'='.join(s)!r}")

    token = admin_token(base, admin_password)
    _, _, body = call(
        base,
        "POST",
        "/v3/projects",
        token,
        {"project": {"name": PROJECT, "domain_id": "default", "description": "Kuryr tests"}},
    )
    project_id = body["project"]["id"]
    _, _, body = call(
        base,
        "POST",
        "/v3/users",
        token,
        {"user": {"name": USER, "domain_id": "default", "password": user_password, "default_project_id": project_id}},
    )
    user_id = body["user"]["id"]
    role_id = find_one(base, token, "roles", ROLE)
    call(base, "PUT", f"/v3/projects/{project_id}/users/{user_id}/roles/{role_id}", token)

    for stype, name, url in services:
        _, _, body = call(base, "POST", "/v3/services", token, {"service": {"type": stype, "name": name}})
        service_id = body["service"]["id"]
        for interface in ("public", "internal", "admin"):
            endpoint = {"service_id": service_id, "interface": interface, "url": url, "region_id": REGION}
            call(base, "POST", "/v3/endpoints", token, {"endpoint": endpoint})

    # An application credential is created by its owner, with a token scoped to the project it
    # will be bound to; it carries the roles the user has there.
    utoken = user_token(base, user_id, user_password, project_id)
    _, _, body = call(
        base,
        "POST",
        f"/v3/users/{user_id}/application_credentials",
        utoken,
        {"application_credential": {"name": APP_CRED, "description": "Kuryr test credential"}},
    )
    cred = body["application_credential"]

    print(f"OS_PROJECT_NAME={PROJECT}")
    print(f"OS_PROJECT_ID={project_id}")
    print(f"OS_USERNAME={USER}")
    print(f"OS_USER_ID={user_id}")
    print(f"OS_PASSWORD={user_password}")
    print(f"OS_APPLICATION_CREDENTIAL_NAME={APP_CRED}")
    print(f"OS_APPLICATION_CREDENTIAL_ID={cred['id']}")
    print(f"OS_APPLICATION_CREDENTIAL_SECRET={cred['secret']}")


if __name__ == "__main__":
    main()
