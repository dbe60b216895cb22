"""Registration with LMDeploy's proxy (`lmdeploy serve proxy`), as LMDeploy's own api_server does
with `--proxy-url`: once the server is serving, POST {proxy}/nodes/add; at shutdown, POST
{proxy}/nodes/remove (LMDeploy's api_server never removes itself: the proxy's heart beat drops it
after a failed GET /health; tern removes itself at once so that no request is routed to a closing
server).

The body is the one lmdeploy/serve/openai/api_server.py (register_to_proxy, v0.18.0) posts:
    {"url": api_server_url, "status": {"models": get_model_list(context), "role": engine_role}}
engine_role is lmdeploy.pytorch.disagg.config.EngineRole's value: Hybrid = 1 (Prefill = 2,
Decode = 3). With a non-empty models list the proxy registers the node without calling it back.
"""

from __future__ import annotations

import httpx

LMDEPLOY_HYBRID_ROLE = 1  # EngineRole.Hybrid.value
PROXY_TIMEOUT_S = 10.0
# /nodes/add answers 200 either way; the body says whether it worked.
ADDED = "Added successfully"


class ProxyRegistrationError(RuntimeError):
    """The proxy could not be reached or refused the node."""


def node_body(server_url: str, model_names: tuple[str, ...]) -> dict[str, object]:
    return {
        "url": server_url,
        "status": {"models": list(model_names), "role": LMDEPLOY_HYBRID_ROLE},
    }


class LMDeployProxyRegistration:
    """This server as a Hybrid node of one LMDeploy proxy."""

    def __init__(self, proxy_url: str, server_url: str, model_names: tuple[str, ...]) -> None:
        self.proxy_url = proxy_url.rstrip("/")
        self.body = node_body(server_url, model_names)
        self.is_registered = False

    async def register(self) -> None:
        """Raises ProxyRegistrationError with the proxy's answer when it does not add the node."""
        url = f"{self.proxy_url}/nodes/add"
        try:
            async with httpx.AsyncClient(timeout=PROXY_TIMEOUT_S) as client:
                response = await client.post(url, json=self.body)
        except httpx.HTTPError as e:
            raise ProxyRegistrationError(f"cannot reach LMDeploy proxy at {url}: {e}") from None
        if response.status_code != 200 or _answer(response) != ADDED:
            raise ProxyRegistrationError(
                f"LMDeploy proxy at {url} refused {self.body['url']}: "
                f"HTTP {response.status_code} {response.text[:500]}"
            )
        self.is_registered = True

    async def remove(self) -> str | None:
        """Best effort: returns why the removal failed, or None."""
        if not self.is_registered:
            return None
        self.is_registered = False
        url = f"{self.proxy_url}/nodes/remove"
        try:
            async with httpx.AsyncClient(timeout=PROXY_TIMEOUT_S) as client:
                response = await client.post(url, json={"url": self.body["url"]})
        except httpx.HTTPError as e:
            return f"cannot reach LMDeploy proxy at {url}: {e}"
        if response.status_code != 200:
            return f"LMDeploy proxy at {url}: HTTP {response.status_code} {response.text[:500]}"
        return None


def _answer(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return response.text
