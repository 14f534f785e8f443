"""Client configuration for a Kubernetes API server reached with a bearer token (and a CA)."""

from __future__ import annotations

import base64
import os
from typing import Any


class TokenClientConfig:
    """`kubeconfig()` and `api_client()` for a server at `url` taking `token` (TLS: `ca_pem`)."""

    url: str
    token: str
    ca_pem: bytes | None

    def kubeconfig(
        self, namespace: str = "default", context: str = "loopback", token: str | None = None
    ) -> dict[str, Any]:
        """A complete kubeconfig document for this server (token auth; CA data when tls);
        `token` instead of the server's own (e.g. a ServiceAccount's)."""
        cluster: dict[str, Any] = {"server": self.url}
        if self.ca_pem:
            cluster["certificate-authority-data"] = base64.b64encode(self.ca_pem).decode()
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": context, "cluster": cluster}],
            "users": [{"name": context, "user": {"token": token or self.token}}],
            "contexts": [
                {
                    "name": context,
                    "context": {"cluster": context, "user": context, "namespace": namespace},
                }
            ],
            "current-context": context,
            "preferences": {},
        }

    def api_client(self, token: str | None = None) -> Any:
        """A `kubernetes.client.ApiClient` for this server (writes no files); `token` instead
        of the server's own (e.g. a ServiceAccount's)."""
        from kubernetes import client

        ca_file = None
        if self.ca_pem:
            # kubernetes<37 (the nemo-run extra's) takes the CA only by path: an in-memory file
            ca_file = os.fdopen(os.memfd_create("loopback-ca", 0), "w+b")
            ca_file.write(self.ca_pem)
            ca_file.flush()
        config = client.Configuration(
            host=self.url,
            api_key={"BearerToken": token or self.token},
            api_key_prefix={"BearerToken": "Bearer"},
            ssl_ca_cert=f"/proc/self/fd/{ca_file.fileno()}" if ca_file else None,
        )
        api_client = client.ApiClient(config)
        api_client._loopback_ca = ca_file  # type: ignore[attr-defined]  # open as long as it lives
        return api_client
